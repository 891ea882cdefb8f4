"""For testing only (`make mutants-flags`, tests/flag_mutants.py): a flag mutant, applied in every Python process.

tests/flag_mutants.py runs the tests with this folder first on PYTHONPATH and FLAG_MUTANT set, so that Python imports
this module at start-up (site's sitecustomize hook) in the pytest process and in every process it starts: launch
scripts, torchrun's agent and ranks, tests/jobs.py's forkserver ranks, the tools' subprocesses. Without FLAG_MUTANT
it does nothing.

FLAG_MUTANT=config:CLASS:FIELD   manual_train.config.parse_config, after validation, gives every config that is an
                                 instance of CLASS the script's default for FIELD (for a boolean the user set: the
                                 opposite), as if the code ignored the user's value.
FLAG_MUTANT=argparse:PROG:DEST   an argparse parser with this prog returns the parser's default for DEST (the tools
                                 whose parsers are plain argparse: parity, bench, and the tuner's own flags).

Each time the mutant changes a value it appends one line to FLAG_MUTANT_HITS (a file), so that the runner can tell a
mutant that no test ever activated from one that ran and was not noticed.
"""
import os
import sys

_SPEC = os.environ.get("FLAG_MUTANT")


def _hit(what: str, old, new) -> None:
    path = os.environ.get("FLAG_MUTANT_HITS")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {what}: {old!r} -> {new!r}\n")


def _install_config(cls_name: str, field: str) -> None:
    import dataclasses

    from manual_train import config

    real = config.parse_config

    def parse_config(config_cls=config.Config, argv=None, **kwargs):
        cfg = real(config_cls, argv, **kwargs)
        if any(c.__name__ == cls_name for c in type(cfg).__mro__):
            declared = {f.name: f for f in dataclasses.fields(cfg)}[field]
            default = kwargs.get(field, declared.default)  # the script's own default (parse_config's **defaults)
            old = getattr(cfg, field)
            if old != default:
                setattr(cfg, field, default)
                _hit(f"{type(cfg).__name__}.{field}", old, default)
        return cfg

    parse_config.__wrapped__ = real
    config.parse_config = parse_config


def _install_argparse(prog: str, dest: str) -> None:
    import argparse

    real = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = real(self, args, namespace)
        if self.prog == prog and hasattr(parsed, dest):
            old, default = getattr(parsed, dest), self.get_default(dest)
            if old != default:
                setattr(parsed, dest, default)
                _hit(f"{prog} {dest}", old, default)
        return parsed, extra

    argparse.ArgumentParser.parse_known_args = parse_known_args


if _SPEC:
    kind, _, rest = _SPEC.partition(":")
    where, _, name = rest.rpartition(":")
    try:
        if kind == "config":
            _install_config(where, name)
        elif kind == "argparse":
            _install_argparse(where, name)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except Exception as e:  # a broken hook must not pass for a surviving mutant: every process says so
        sys.stderr.write(f"FLAG_MUTANT={_SPEC}: the hook failed to install: {e!r}\n")
        raise
