"""`python -m trl_dart_es.benchmark`: the harness's command line (and the entry point of its child processes)."""

from .cli import main

if __name__ == "__main__":  # the guard lets vLLM's spawned workers import this module safely
    main()
