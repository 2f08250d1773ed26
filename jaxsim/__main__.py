"""`python -m jaxsim COMMAND [options]`: the commands live in jaxsim.cli (jaxsim/cli/main.py)."""
from jaxsim.cli.main import main
from jaxsim.runtime import exit_process

if __name__ == "__main__":
    exit_process(main())
