"""STS evaluation by the SimCSE protocol, with label-free calibrations, and SentEval's transfer
tasks: `python eval.py [--model M] [--post whitening] [--tasks ...]`.

Flags: `python eval.py --help`; the command line is jaxsim/cli/eval.py.
"""
import os
import signal

if __name__ == '__main__':
    # Hold Ctrl-C / SIGTERM back while JAX and transformers import (seconds); main() installs
    # the handlers that report them in one line, and the held signal is delivered then.
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))

# Before numpy loads: the eval's linear algebra is small (docs/performance.md).
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

from jaxsim.cli.eval import main  # noqa: E402
from jaxsim.runtime import exit_process  # noqa: E402

if __name__ == '__main__':
    exit_process(main())
