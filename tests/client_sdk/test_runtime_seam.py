"""The client's model runs through the engine's forward with encrypted layers behind the attention seam.

A real bundle (``fhe.bundle``: the encrypted layer's projections and input-norm gain withheld) of a small
random Llama is loaded the way the runtime loads it; the encrypted layer's server side is played by the
full model's own attention in plaintext (what the CKKS block approximates). Logits must equal the
reference forward's — for a prefill in chunks and a decode step — so the seam, the unit-gain norm and the
positions are wired right without any ciphertext. (Real ciphertexts: test_private_parity.py.)
"""

from __future__ import annotations

import torch

from client_sdk._runtime import EncryptedAttention, EncryptedBackend, StepStats, client_model
from engine.config import ModelConfig
from engine.model import DenseKVCache, LlamaForCausalLM

ENCRYPTED = (1, 2)


def random_llama(cfg: ModelConfig, std: float) -> LlamaForCausalLM:
    """A Llama of ``cfg`` with N(0, std) weights and norm gains in [0.5, 1.5] (gains != 1: folding must matter)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.eval()


def tiny() -> LlamaForCausalLM:
    return random_llama(ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                                    tie_word_embeddings=True, max_position_embeddings=64), 0.3)


class PlaintextServer:
    """Stands in for the runtime's ``encrypted_attention``: the full model's attention of that layer on
    gain * x̂, over its own cache (what the server's encrypted KV cache holds)."""

    def __init__(self, full: LlamaForCausalLM, max_len: int) -> None:
        self.full, self.cache = full, DenseKVCache(full.config, max_len)
        self.calls: list[tuple[int, int, int]] = []

    def encrypted_attention(self, layer: int, start: int, x: torch.Tensor, stats: StepStats) -> torch.Tensor:
        self.calls.append((layer, start, x.shape[0]))
        block = self.full.layers[layer]
        pos = torch.arange(start, start + x.shape[0])
        self.cache.length = start
        out = block.self_attn(block.input_layernorm.weight * x, pos, self.full.rotary, self.cache)
        stats.steps += 1
        return out


def client_from_bundle(full: LlamaForCausalLM, tmp_path) -> torch.nn.Module:
    from fhe.bundle import read_bundle, write_bundle

    write_bundle(full, tmp_path, ENCRYPTED, "0" * 64, tmp_path / "b.safetensors")
    model, meta = read_bundle(tmp_path / "b.safetensors", tmp_path / "files")
    assert model.layers[1].self_attn.q_proj.weight.is_meta   # really withheld
    return client_model(model, ENCRYPTED)


@torch.inference_mode()
def test_seam_reproduces_the_reference_forward(tmp_path):
    full = tiny()
    client = client_from_bundle(full, tmp_path)
    assert all(isinstance(client.layers[i].self_attn, EncryptedAttention) for i in ENCRYPTED)
    ids = [5, 17, 3, 44, 9, 61, 2]
    ref_cache = DenseKVCache(full.config, 16)
    ref = full.logits(full(torch.tensor(ids), torch.arange(len(ids)), ref_cache))
    ref_cache.advance()
    ref_next = full.logits(full(torch.tensor([7]), torch.tensor([len(ids)]), ref_cache))

    server = PlaintextServer(full, 16)
    backend = EncryptedBackend(server, DenseKVCache(full.config, 16), StepStats())
    logits = []
    for start in (0, 4):                                   # a prefill in two chunks, as max_step_tokens does
        chunk = ids[start:start + 4]
        h = client(torch.tensor(chunk), torch.arange(start, start + len(chunk)), backend)
        backend.cache.advance()
        logits.append(client.logits(h))
    h = client(torch.tensor([7]), torch.tensor([len(ids)]), backend)
    torch.testing.assert_close(torch.cat(logits), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(client.logits(h), ref_next, rtol=1e-4, atol=1e-4)
    assert server.calls == [(1, 0, 4), (2, 0, 4), (1, 4, 3), (2, 4, 3), (1, 7, 1), (2, 7, 1)]
    assert backend.stats.steps == 6
