"""What rtmem.torch._module_state finds of a stage module's own state."""

import pytest

torch = pytest.importorskip("torch")

from rtmem.torch._module_state import stage_state  # noqa: E402


def test_a_sparse_attribute_is_model_state_through_its_indices_and_values():
    # a sparse tensor has no storage of its own: autograd saves its indices or
    # values (the indices of a graph's message passing), so both are the
    # constants a move must never free
    m = torch.nn.Linear(2, 2)
    m.adj = torch.eye(3).to_sparse()
    consts, gens = stage_state([m])
    assert gens == []
    assert sorted(t.data_ptr() for t in consts) == sorted(
        t.data_ptr() for t in (m.adj._indices(), m.adj._values()))
