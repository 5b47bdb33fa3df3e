"""Gossip topologies: column-stochastic mixing matrices, no self-loops, the right peers."""

import typing

import numpy as np
import pytest

from gradcomm import topology

DIRECTED = ["exponential", "exponential-2peer", "ring", "complete"]
SYMMETRIC = ["exponential-bidirectional", "ring-bidirectional", "complete"]


@pytest.mark.parametrize("name", sorted(topology.TOPOLOGIES))
@pytest.mark.parametrize("n", range(1, 17))
def test_every_mixing_matrix_is_column_stochastic_without_self_loops(name, n):
    if name == "hypercube" and n & (n - 1):
        with pytest.raises(ValueError, match="power-of-two"):
            topology.resolve(name, n)
        return
    graph = topology.resolve(name, n)
    for k in range(2 * graph.num_phases):
        p = graph.mixing_matrix(k)
        np.testing.assert_allclose(p.sum(0), 1, rtol=1e-12)
        assert np.all(p >= 0)
        share = 1 / (graph.peers(k) + 1)
        np.testing.assert_allclose(np.diag(p), share)  # only the kept share, no self-loop
    if name in SYMMETRIC or name == "hypercube":
        assert graph.is_symmetric() and graph.is_doubly_stochastic()


@pytest.mark.parametrize("n", range(2, 17))
def test_one_peer_exponential_sends_to_i_plus_two_to_the_k_mod_m(n):
    graph = topology.exponential(n)
    m = (n - 1).bit_length()
    assert graph.num_phases == m
    for k in range(3 * m):
        [move] = graph.phases[k % m]
        assert move == tuple((i + 2 ** (k % m)) % n for i in range(n))


def test_p_peer_exponential_shifts_and_skips_self_loops():
    graph = topology.exponential(9, peers=2)
    shifts = [[(move[0] - 0) % 9 for move in phase] for phase in graph.phases]
    assert shifts == [[1, 2], [3, 6]]
    six = topology.exponential(6, peers=2)  # 2 * 3 = 6 wraps to 0: dropped
    assert [[m[0] for m in phase] for phase in six.phases] == [[1, 2], [3]]


def test_printing_and_errors():
    text = str(topology.exponential(8))
    assert "step k = 2 mod 3: i -> i + 4" in text
    assert "no messages" in str(topology.exponential(1))
    with pytest.raises(ValueError, match="unknown topology"):
        topology.resolve("star", 4)
    with pytest.raises(ValueError, match="unknown topology"):
        topology.check_topology("star")
    with pytest.raises(ValueError, match="not for 4 devices"):
        topology.resolve(topology.ring(3), 4)
    with pytest.raises(ValueError, match="self-loop"):
        topology.Topology("bad", 2, (((0, 1),),), ("identity",))
    with pytest.raises(ValueError, match="peers"):
        topology.exponential(4, peers=0)


def test_the_name_type_lists_every_topology():
    assert set(typing.get_args(topology.Name)) == set(topology.TOPOLOGIES)
