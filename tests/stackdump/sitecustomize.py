"""Test-only: a Python process started by the tests dumps its threads' stacks when it gets the stack signal.

tests/conftest.py's run_script puts this folder first on PYTHONPATH and sets TESTS_STACK_DIR, so every Python
process of a launched job (torchrun's agent, its ranks, their compile workers) imports this at start-up and writes
its stacks to TESTS_STACK_DIR/<pid>.txt when tests/jobs.py's watcher finds the job hung, just before it kills it:
the failure then says where each rank was waiting. faulthandler writes from its C signal handler, so a rank blocked
inside a gloo collective (C++, not running Python) dumps too. The signal is a real-time one that neither the
launch scripts (--save-on-signal takes TERM, USR1, USR2, HUP) nor torchrun handle.
"""
import faulthandler
import os
import signal

if os.environ.get("TESTS_STACK_DIR"):
    try:
        _stack_file = open(os.path.join(os.environ["TESTS_STACK_DIR"], f"{os.getpid()}.txt"), "w")
        faulthandler.register(signal.SIGRTMIN + 3, file=_stack_file, all_threads=True)
    except OSError:  # the folder is gone (the test ended while this process started): nothing to dump into
        pass


def _chain() -> None:
    """Python imports one sitecustomize, the first on sys.path: this folder's, which run_script puts first, would hide
    any other further on (tests/flag_hook's under `make mutants-flags`, which must reach a launched job's processes
    too; or the system's own). Run that one as well, as if this folder were not there."""
    import importlib.util
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in sys.path:
        path = os.path.join(folder or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(os.path.dirname(path)) != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return


_chain()
