"""For testing only (`make mutants-flags`, tests/flag_mutants.py): a flag mutant, applied in every Python process.

tests/flag_mutants.py runs the tests with this folder first on PYTHONPATH and FLAG_MUTANT set, so that Python imports
this module at start-up (site's sitecustomize hook) in the pytest process and in every process it starts: launch
scripts, torchrun's agent and ranks, tests/jobs.py's forkserver ranks, the tools' subprocesses. Without FLAG_MUTANT
it does nothing.

FLAG_MUTANT=config:CLASS:FIELD   manual_train.config.parse_config, after validation, gives every config that is an
                                 instance of CLASS the script's default for FIELD (for a boolean the user set: the
                                 opposite), as if the code ignored the user's value; a parser a tool builds with
                                 config.build_parser(CLASS) and parses itself (the tuner's) returns that default.
FLAG_MUTANT=argparse:PROG:DEST   an argparse parser with this prog returns the parser's default for DEST (the tools
                                 whose parsers are plain argparse: parity, bench, and the tuner's own flags).

The mutant is read from the environment at each call: flag_plan.py (the pytest plugin of the runner) sets one after
the other in one pytest process, and every process a test starts inherits the one in force. Each time the mutant
changes a value it appends one line to FLAG_MUTANT_HITS (a file), so that the runner can tell a
mutant that no test ever activated from one that ran and was not noticed.
"""
import os
import sys


def _target(kind: str):
    """(where, name) of the mutant FLAG_MUTANT names now, if it is of this kind; read at each call, so that one
    pytest process (tests/flag_hook/flag_plan.py) can run mutant after mutant, its subprocesses inheriting each."""
    got, _, rest = os.environ.get("FLAG_MUTANT", "").partition(":")
    where, _, name = rest.rpartition(":")
    return (where, name) if got == kind else None


def _hit(what: str, old, new) -> None:
    path = os.environ.get("FLAG_MUTANT_HITS")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {what}: {old!r} -> {new!r}\n")


def _install_config() -> None:
    import dataclasses

    from manual_train import config

    real, real_build = config.parse_config, config.build_parser
    inside = []  # parse_config calls in progress (its parser's values are mutated after validation, below)

    def parse_config(config_cls=config.Config, argv=None, **kwargs):
        inside.append(1)
        try:
            cfg = real(config_cls, argv, **kwargs)
        finally:
            inside.pop()
        target = _target("config")
        if target and any(c.__name__ == target[0] for c in type(cfg).__mro__):
            field = target[1]
            declared = {f.name: f for f in dataclasses.fields(cfg)}[field]
            default = kwargs.get(field, declared.default)  # the script's own default (parse_config's **defaults)
            old = getattr(cfg, field)
            if old != default:
                setattr(cfg, field, default)
                _hit(f"{type(cfg).__name__}.{field}", old, default)
        return cfg

    def build_parser(config_cls=config.Config, **kwargs):
        """A parser a tool parses itself (the tuner's TuneFlags): the argparse hook mutates what it returns."""
        parser = real_build(config_cls, **kwargs)
        if not inside:
            parser._flag_mutant_classes = [c.__name__ for c in config_cls.__mro__]
        return parser

    parse_config.__wrapped__, build_parser.__wrapped__ = real, real_build
    config.parse_config, config.build_parser = parse_config, build_parser


def _install_argparse() -> None:
    import argparse

    real = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = real(self, args, namespace)
        by_prog, by_class = _target("argparse"), _target("config")
        if by_prog and by_prog[0] == self.prog:
            dest = by_prog[1]
        elif by_class and by_class[0] in getattr(self, "_flag_mutant_classes", ()):  # built by build_parser(CLASS)
            dest = by_class[1]
        else:
            return parsed, extra
        if hasattr(parsed, dest):
            old, default = getattr(parsed, dest), self.get_default(dest)
            if old != default:
                setattr(parsed, dest, default)
                _hit(f"{self.prog} {dest}", old, default)
        return parsed, extra

    argparse.ArgumentParser.parse_known_args = parse_known_args


if "FLAG_MUTANT" in os.environ:  # set (even empty: flag_plan.py sets each mutant in turn): install both wrappers
    try:
        _install_config()
        _install_argparse()
    except Exception as e:  # a broken hook must not pass for a surviving mutant: every process says so
        sys.stderr.write(f"FLAG_MUTANT: the hook failed to install: {e!r}\n")
        raise
