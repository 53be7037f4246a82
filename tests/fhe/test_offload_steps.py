"""The offload plan's wire pieces: the envelope's ``part`` field (old envelopes unchanged) and the MLP
geometry the client builds from shapes alone (equal to the server block's, which has the weights)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model import DecoderLayer
from fhe import envelope
from fhe.envelope import Envelope, EnvelopeError, parse
from fhe.mlp import MLP_PARAMS, EncryptedMLP
from fhe.offload_steps import chunk_shapes, fresh_blob_limit, mlp_geometry, offload_rotation_steps, outputs_per_position


def _env(**kw) -> Envelope:
    fields = dict(session="ps_x", key_fingerprint="ab" * 32, layer=2, kind="decode", positions=(5, 1),
                  blobs=(b"abc",))
    return Envelope(**{**fields, **kw})


@pytest.mark.parametrize("part", ["mlp_up", "mlp_down", "attn_qkv", "attn_o"])
def test_an_offload_part_round_trips(part):
    env = _env(part=part)
    got = parse(env.to_bytes(), 1 << 20, 1 << 20)
    assert got == env and got.part == part


def test_an_attention_envelope_is_byte_for_byte_what_it_was():
    """No ``part`` in an attention step's header: older servers and retries see the same bytes."""
    env = _env()
    assert "part" not in env.header()
    assert parse(env.to_bytes(), 1 << 20, 1 << 20).part == envelope.ATTENTION


def test_an_envelope_without_part_parses_as_attention():
    import rfc8785

    head = {k: v for k, v in _env().header().items() if k != "part"}
    raw = rfc8785.dumps(head)
    body = envelope._PREFIX.pack(envelope.MAGIC, envelope.ENVELOPE_VERSION, len(raw)) + raw + b"abc"
    assert parse(body, 1 << 20, 1 << 20).part == "attention"


@pytest.mark.parametrize("bad", ["mlp", "MLP_UP", "", 3, None, ["mlp_up"]])
def test_an_unknown_part_is_refused(bad):
    import rfc8785

    head = {**_env().header(), "part": bad}
    raw = rfc8785.dumps(head)
    body = envelope._PREFIX.pack(envelope.MAGIC, envelope.ENVELOPE_VERSION, len(raw)) + raw + b"abc"
    with pytest.raises(EnvelopeError, match="part"):
        parse(body, 1 << 20, 1 << 20)


def test_the_client_geometry_is_the_server_blocks():
    """A random layer's EncryptedMLP (weights) and mlp_geometry (shapes only) agree on every slot."""
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0)
    server = EncryptedMLP(layer, MLP_PARAMS)
    layout, steps = mlp_geometry(cfg, MLP_PARAMS)
    assert set(steps) <= server.rotation_steps
    assert offload_rotation_steps(cfg, MLP_PARAMS, attention=False) == tuple(sorted(server.rotation_steps))
    chunks = chunk_shapes(cfg, MLP_PARAMS)                   # a multi-position step's layout, from shapes
    assert all(server.chunks.shapes[p] == chunks[p] for p in ("mlp_up", "mlp_down"))
    ref = server.layout
    assert (layout.up_periods, layout.down_period) == (ref.up_periods, ref.down_period)
    assert all((a == b).all() for a, b in zip(layout.up_slots, ref.up_slots, strict=True))
    assert (layout.down_slots == ref.down_slots).all()
    assert outputs_per_position(layout, "mlp_up") == len(ref.up_slots)
    assert outputs_per_position(layout, "mlp_down") == 1


def test_the_blob_limit_holds_a_fresh_ciphertext():
    """A full (unseeded) fresh MLP ciphertext fits the per-blob limit; twice that does not."""
    from fhe.backends.seal import wire
    from fhe.backends.seal.keys import CKKSClient

    client = CKKSClient(MLP_PARAMS, ())
    full = wire.dump_ciphertext(client.encrypt([0.5] * 16), MLP_PARAMS, client.fingerprint)
    seeded = wire.encrypt_to_wire(client, [0.5] * 16)
    assert len(seeded) < len(full) <= fresh_blob_limit(MLP_PARAMS) < 2 * len(full)


def test_one_key_set_covers_attention_and_mlp_steps():
    """The offload key set's Galois steps are the union of both blocks' (servers build them from weights)."""
    from fhe.offload_attention import EncryptedAttentionLinear
    from fhe.offload_steps import offload_rotation_steps

    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0)
    att, mlp = EncryptedAttentionLinear(layer, cfg, MLP_PARAMS), EncryptedMLP(layer, MLP_PARAMS)
    assert offload_rotation_steps(cfg, MLP_PARAMS) == tuple(sorted(att.rotation_steps | mlp.rotation_steps))
    assert set(mlp_geometry(cfg, MLP_PARAMS)[1]) <= set(offload_rotation_steps(cfg, MLP_PARAMS, attention=False))
