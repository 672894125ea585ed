"""Activation memory of the MoE layer (moe.py): what it keeps for backward, EP=2 against EP=1.

What these tests prove, on CPU (gloo), under bf16 autocast over fp32 weights as in training,
counting the unique storages saved for backward (torch.autograd.graph.saved_tensors_hooks),
parameters excluded:
- dropless, the saved bytes do not depend on the routing: every token sent to the same two
  experts saves exactly what perfectly balanced routing saves. Each expert takes exactly its rows;
  a buffer zero-padded to the busiest expert would keep up to E/k times the slot activations;
- with balanced routing (so that each EP rank receives exactly k N slots, as many as one process
  computes), EP=2 saves per rank at most what EP=1 saves, minus the bf16 copies of the experts the
  rank does not hold (2 bytes x (E - E/ep) x expert parameters: the matmuls keep their cast
  weights), plus, dropless, two int64 per slot (the permutation that regroups received slots by
  local expert, and its inverse, kept by EP's index ops); with capacity_factor 1.25 plus nothing.
  Everything else the layer keeps is sized by slots and is the same in both layouts: the
  all-to-all send and receive buffers are not kept for backward.
"""
import json
from types import SimpleNamespace

import pytest
import torch

import moe
import parallel
from distributed import spawn
from model import ModelConfig, make_moe

pytestmark = pytest.mark.usefixtures("one_thread")

E, K, B, T, C, H = 8, 2, 2, 64, 64, 128  # T a multiple of E: every sequence is balanced


def layer_of(cf):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, block_size=T, n_layer=1, n_head=2, n_embd=C, n_experts=E, moe_top_k=K,
                      moe_hidden=H, activation="swiglu", capacity_factor=cf)
    layer = make_moe(cfg)
    with torch.no_grad():  # the router reads the first E features: a token's choices are set by x
        layer.router.weight.zero_()
        layer.router.weight[:, :E] = torch.eye(E)
    return layer


def tokens(seed, balanced=True):
    """(B, T, C): token n chooses experts n mod E, then (n + 1) mod E (balanced), or 0 then 1."""
    g = torch.Generator().manual_seed(seed)
    x = 0.01 * torch.randn(B * T, C, generator=g)
    n = torch.arange(B * T)
    first, second = (n % E, (n + 1) % E) if balanced else (n * 0, n * 0 + 1)
    x[n, first] += 4.0
    x[n, second] += 2.0
    return x.view(B, T, C)


def saved_bytes(layer, x):
    """Bytes of the unique storages saved for backward by one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    x = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()  # the graph is usable: backward runs
    assert layer.stats["dropped"].item() == 0  # every slot computed: the layouts do the same work
    return sum(seen.values())


def test_dropless_saved_bytes_do_not_depend_on_routing():
    layer = layer_of(0.0)
    balanced, skewed = saved_bytes(layer, tokens(0)), saved_bytes(layer, tokens(0, balanced=False))
    assert layer.stats["load"][:2].tolist() == [0.5, 0.5]  # the skewed input did go to 2 experts
    assert skewed == balanced, f"skewed routing saves {skewed} bytes, balanced {balanced}"


CAPACITIES = [0.0, 1.25]  # dropless, and with a capacity


def _ep_saved(rank, out):
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=2))
    for cf in CAPACITIES:  # both in one spawn
        layer = moe.expert_parallel(layer_of(cf), grid)
        with open(f"{out}/cf{cf}_rank{rank}.json", "w") as f:
            json.dump(saved_bytes(layer, tokens(rank)), f)


@pytest.fixture(scope="module")
def ep2_saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep2")
    spawn(_ep_saved, 2, str(out))
    return out


@pytest.mark.parametrize("cf", CAPACITIES)
def test_ep2_saves_no_more_than_ep1(ep2_saved, cf):
    ep, N = 2, B * T
    layer = layer_of(cf)
    not_held = 2 * (E - E // ep) * layer.expert_numel()  # bf16 expert copies EP=2 does not make
    index = 2 * 8 * K * N if cf == 0 else 0  # dropless: regrouping permutation + inverse, int64
    for rank in range(ep):
        ep1 = saved_bytes(layer, tokens(rank))
        ep2 = json.load(open(ep2_saved / f"cf{cf}_rank{rank}.json"))
        bound = ep1 - not_held + index
        assert ep2 <= bound, f"rank {rank}: EP=2 saves {ep2} bytes > bound {bound} (EP=1 {ep1})"
