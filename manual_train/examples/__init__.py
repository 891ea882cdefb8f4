"""Worked examples of your own model and dataset (docs/your-model.md): a subpackage, because the repository's top
level is fixed (setup.cfg, setup.py, manual_train/, launch/, tests/, docs/)."""
