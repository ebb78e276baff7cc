"""The repository's and the tests' folders, for tests in the floor folders below ``tests/``
(``pyproject.toml`` puts ``tests/`` on the path, so any test imports this and
``pipeline_models``) and for the processes they launch (their ``PYTHONPATH``)."""

import os

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT_DIR = os.path.dirname(TESTS_DIR)
