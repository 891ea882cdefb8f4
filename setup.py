# All metadata lives in setup.cfg; this shim lets `pip install -e .` work with older pip/setuptools.
from setuptools import setup

setup()
