"""The suite's tiers (tests/conftest.py): a test's marker is read from its code and the helpers it reaches."""

from __future__ import annotations

import sys

import conftest


def test_a_helper_that_imports_train_locally_is_integration_even_before_any_module_imported_train(monkeypatch):
    """``run_train`` imports train inside itself; collected before any test module imported train, its ``train.main``
    was not found and a test calling it was marked unit (then failed as "marked unit but ran train.main")."""
    monkeypatch.delitem(sys.modules, "train", raising=False)
    assert "train" in conftest._uses_of(conftest.run_train)


def test_a_test_that_only_tokenizes_is_unit():
    def only_tokenizes():
        import preference_datasets

        return preference_datasets.left_pad([[1, 2], [3]], 0)

    assert conftest._uses_of(only_tokenizes) == frozenset()
