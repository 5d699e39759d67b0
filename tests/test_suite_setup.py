"""The suite's own machinery. tests/compile_groups.py: GROUPS names test files that exist, each once;
collected items come out in GROUPS' order with each file's tests together and in their own order; a group
is one scheduling unit. conftest: forgetting jit's dispatches makes jax.no_tracing() catch a call that
was dispatched before, and the call dispatches again without being traced anew."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests import compile_groups


@pytest.mark.cpu_test
def test_groups_name_existing_test_files_once():
    assert compile_groups.check_groups() == []


@pytest.mark.cpu_test
def test_items_follow_the_groups_order_and_files_stay_together():
    (first, second, *_), (third, *_) = list(compile_groups.GROUPS.values())[:2]
    nodeids = ["tests/test_unlisted_a.py::t1", f"tests/{third}::t1", f"tests/{second}::t1", f"tests/{first}::t1",
               "tests/test_unlisted_b.py::t1", f"tests/{third}::t2", "tests/test_unlisted_a.py::t2",
               f"tests/{first}::t2"]
    items = [SimpleNamespace(nodeid=n) for n in nodeids]
    compile_groups.order_items(items)
    assert [item.nodeid for item in items] == [
        f"tests/{first}::t1", f"tests/{first}::t2", f"tests/{second}::t1", f"tests/{third}::t1",
        f"tests/{third}::t2", "tests/test_unlisted_a.py::t1", "tests/test_unlisted_a.py::t2",
        "tests/test_unlisted_b.py::t1"]


@pytest.mark.cpu_test
def test_a_group_is_one_scheduling_unit():
    scheduling = compile_groups.GroupScheduling.__new__(compile_groups.GroupScheduling)
    group, names = next(iter(compile_groups.GROUPS.items()))
    scopes = {scheduling._split_scope(f"tests/{name}::test_x[1]") for name in names}
    assert scopes == {f"group:{group}"}
    assert scheduling._split_scope("tests/test_unlisted.py::test_x") == "test_unlisted.py"


def test_forgotten_dispatches_are_caught_by_no_tracing_and_not_traced_again():
    import jax
    import jax.numpy as jnp

    from tests.conftest import _forget_jit_dispatches

    traces = []

    @jax.jit
    def double(x):
        traces.append(x.shape)
        return 2 * x

    x = jnp.arange(3.0)
    double(x)
    with jax.no_tracing():
        double(x)  # dispatched before: no tracing
    _forget_jit_dispatches()
    with pytest.raises(RuntimeError, match="no_tracing"):
        with jax.no_tracing():
            double(x)
    assert double(x + 1).tolist() == [2.0, 4.0, 6.0]
    assert traces == [(3,)]  # traced once: the forgotten dispatch found its program
