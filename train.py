"""Train a sentence encoder: `python train.py --config configs/NAME.py --workdir DIR`.

Flags: `python train.py --help`; the command line is jaxsim/cli/train.py.
"""
import signal

if __name__ == '__main__':
    # Hold Ctrl-C / SIGTERM back while JAX and transformers import; the command delivers a held
    # signal once its handler is in place, so it ends in one line like any other.
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))

from jaxsim.cli.train import main  # noqa: E402
from jaxsim.runtime import exit_process  # noqa: E402

if __name__ == '__main__':
    exit_process(main())
