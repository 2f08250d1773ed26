"""The command lines: every command's parser and entry point, and what they share.

    python -m jaxsim COMMAND [options]   main.py dispatches to one module a command:
                                         encode, export, index + search (search.py), serve,
                                         prepare, analyze, plan
    python train.py / python eval.py     thin scripts over train.py / eval.py here
    python -m jaxsim.cli.corpus          SentEval files -> training files (corpus.py)

cli_io.py holds the shared flags and checks (sentence inputs, outputs, seeds, --import) and the
one-line error report; interrupts.py the one-line SIGINT / SIGTERM report; environment.py the
library quieting every command applies first. Library code below takes plain arguments, never
an argparse Namespace, and nothing outside this package imports argparse.

Importing this package imports nothing (jaxsim/__init__.py reaches interrupts.py before JAX).
"""
