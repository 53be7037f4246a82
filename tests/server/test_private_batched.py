"""Several sessions' linear steps of one (layer, part) in one worker call (``PrivateCompute.mlp_step_batch``,
the gpu backend's batched evaluator on its torch-CPU reference): each session's answer is the one it gets
alone on SEAL, byte for byte, under its own key set; an item with bad bytes fails alone.

The tiny model (hidden 64) with an offload plan of linear steps only: layer 0's attention and MLP on the
server, no attention plan (the worker builds no attention block).
"""

from __future__ import annotations

import numpy as np
import pytest

from server.private.codes import TaskFailure, WorkerCode
from tests.server.app_helpers import tiny_model_dir  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def plan_path(tiny_model_dir, tmp_path_factory):  # noqa: F811
    from engine.loader import load_model
    from fhe.offload import CLIENT, SERVER, LayerPlacement, OffloadPlan

    model = load_model(tiny_model_dir)
    layers = (LayerPlacement(0, SERVER, SERVER, "client", "client"), LayerPlacement(1, CLIENT, CLIENT))
    return str(OffloadPlan("tiny", model.config.to_hf_dict(), layers).save(tmp_path_factory.mktemp("p") / "o.json"))


@pytest.fixture(scope="module")
def worker(tiny_model_dir, plan_path):  # noqa: F811
    from server.private.compute import PrivateCompute

    return PrivateCompute(str(tiny_model_dir), None, 16, "cpu-reference", 1, plan_path)


@pytest.fixture(scope="module")
def seal_worker(tiny_model_dir, plan_path):  # noqa: F811
    from server.private.compute import PrivateCompute

    return PrivateCompute(str(tiny_model_dir), None, 16, "cpu", 1, plan_path)


def _sessions(workers, count: int):
    """``count`` clients with their own key sets loaded in each of ``workers``: (fingerprint, client) each."""
    import hashlib

    from fhe.backends.seal import wire
    from fhe.backends.seal.keys import CKKSClient
    from fhe.envelope import pack_key_upload

    out = []
    for _ in range(count):
        client = CKKSClient(workers[0].linear.params, workers[0].linear.steps)
        upload = pack_key_upload(wire.dump_public_keys(client))
        fp = hashlib.sha256(upload).hexdigest()
        for worker in workers:
            worker.load_key(fp, upload)
        out.append((fp, client))
    return out


def _canonical(worker, fp: str, blob: bytes) -> bytes:
    """A result blob parsed by SEAL (as the client does) and saved again: equal for equal ciphertexts."""
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal import wire

    keys = worker.linear.keys[fp]
    return seal.to_bytes(wire.load_ciphertext(blob, keys.kit, keys.fingerprint))


def _blob(client, slots: int, rng) -> bytes:
    from fhe.backends.seal import wire

    return wire.encrypt_to_wire(client, np.resize(rng.normal(size=64), slots))


@pytest.mark.parametrize("part", ["mlp_up", "attn_qkv"])
def test_a_batch_answers_each_session_as_alone_and_a_bad_item_fails_alone(worker, seal_worker, part):
    rng = np.random.default_rng(0)
    sessions = _sessions((worker, seal_worker), 3)
    slots = worker.linear.params.slots
    items = [(fp, 0, part, [_blob(c, slots, rng) for _ in range(n)])
             for (fp, c), n in zip(sessions, (1, 2, 1), strict=True)]
    items.append((sessions[0][0], 0, part, [b"\0" * 64]))          # garbage: this item alone fails
    got = worker.mlp_step_batch(items)
    alone = [seal_worker.mlp_step(*item) for item in items[:3]]   # SEAL, one session at a time
    # the batch sends the device's uncompressed SEAL form, SEAL its zstd form: the same ciphertexts
    got_ct = [[_canonical(worker, fp, b) for b in out] for (fp, *_), out in zip(items, got[:3], strict=False)]
    assert got_ct == [[_canonical(worker, fp, b) for b in out] for (fp, *_), out in zip(items, alone, strict=False)]
    assert [len(o) for o in got[:3]] == [len(o) for o in alone] and all(len(o) for o in alone)
    assert len({c for out in got_ct for c in out}) == sum(len(out) for out in got_ct)   # rows differ
    assert isinstance(got[3], TaskFailure) and got[3].code is WorkerCode.BAD_CIPHERTEXT


@pytest.mark.parametrize("part", ["mlp_up", "mlp_down", "attn_qkv", "attn_o"])
def test_a_chunk_step_on_the_gpu_reference_is_seals_answer(worker, seal_worker, part):
    """A step of several positions (``packed``: the interleaved chunk layout, T ciphertexts per chunk in, G out)
    runs on the gpu evaluator as one batched step, a chunk per row, padded to ``CHUNK_ROWS`` rows (what a CUDA
    graph replays); its answer is SEAL's, ciphertext for ciphertext; in a batch call it runs alone."""
    rng = np.random.default_rng(1)
    (fp, client), = _sessions((worker, seal_worker), 1)
    block, _ = seal_worker.linear.part(0, part)
    sh = block.chunks.shapes[part]
    from fhe.backends.seal import wire

    blobs = [wire.encrypt_to_wire(client, v) for c in range(2)
             for v in sh.pack(rng.normal(size=(sh.positions - c, sh.n_in)))]        # two chunks, one short
    want = [_canonical(seal_worker, fp, b) for b in seal_worker.mlp_step(fp, 0, part, blobs, True)]
    assert len(want) == 2 * sh.groups
    assert [_canonical(worker, fp, b) for b in worker.mlp_step(fp, 0, part, blobs, True)] == want
    got, = worker.mlp_step_batch([(fp, 0, part, blobs, True)])
    assert [_canonical(worker, fp, b) for b in got] == want


def test_the_warm_up_keys_have_a_real_key_sets_shape(worker):
    """``warm`` captures the graphs with zero keys: they must have the Galois elements and shapes of a real
    offload key set, else every real step would capture its graphs again (the graph cache is keyed on them)."""
    from fhe.backends.gpu.step import StepGraphs
    from server.private.compute import placeholder_keys

    (fp, _), = _sessions((worker,), 1)
    lin = worker.linear
    real, fake = lin.device_keys[fp], placeholder_keys(lin.gpu, lin.steps)
    assert StepGraphs._signature(fake) == StepGraphs._signature(real)
    assert fake.relin.shape == real.relin.shape and not any(t.any() for t in fake.galois.values())
    assert lin.warm() == 0.0 and lin.warm_s == 0.0          # off CUDA there is nothing to capture


@pytest.mark.gpu
def test_a_cuda_worker_captures_every_graph_at_start_and_answers_like_seal(tiny_model_dir, plan_path,  # noqa: F811
                                                                           seal_worker):
    """On CUDA the worker captures each linear step's graphs when it starts (one position, and CHUNK_ROWS
    chunks), so real steps replay without capturing; its answers (on-device encoder) decrypt to the SEAL
    worker's within 1e-6 of their range, and with SEAL's encoder a chunk step is SEAL's, ciphertext for ciphertext."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal import wire
    from server.private.compute import PrivateCompute, _OffloadLinear

    gpu = PrivateCompute(str(tiny_model_dir), None, 16, "cuda", 1, plan_path)
    lin = gpu.linear
    assert lin.gpu.encoder == "fft" and lin.warm_s > 0 and lin.graphs.captures == 2 * len(lin.parts()) == 8
    (fp, client), = _sessions((gpu, seal_worker), 1)
    rng = np.random.default_rng(3)
    for part in ("attn_qkv", "attn_o", "mlp_up", "mlp_down"):
        sh = seal_worker.linear.part(0, part)[0].chunks.shapes[part]
        chunk = [wire.encrypt_to_wire(client, v) for c in range(2)
                 for v in sh.pack(rng.normal(size=(sh.positions - c, sh.n_in)))]
        for blobs, packed in (([_blob(client, lin.params.slots, rng)], False), (chunk, True)):
            want, got = (w.mlp_step(fp, 0, part, blobs, packed) for w in (seal_worker, gpu))
            keys = lin.keys[fp]
            dec = [np.stack([client.decrypt(wire.load_ciphertext(b, keys.kit, keys.fingerprint)) for b in out])
                   for out in (want, got)]
            assert np.abs(dec[1] - dec[0]).max() <= 1e-6 * np.abs(dec[0]).max(), (part, packed)
    assert lin.graphs.captures == 8                         # every real step replayed a warm graph
    exact = _OffloadLinear(_model(tiny_model_dir), plan_path, "cuda", encoder="seal")
    exact.load_key(fp, seal_worker.linear.keys[fp])
    for part in ("mlp_up", "attn_o"):
        sh = seal_worker.linear.part(0, part)[0].chunks.shapes[part]
        cts = [client.encrypt(v) for v in sh.pack(rng.normal(size=(sh.positions, sh.n_in)))]
        want = seal_worker.linear.run_chunks(fp, 0, part, cts)
        got = exact.run_chunks(fp, 0, part, cts)
        assert [seal.to_bytes(c) for c in got] == [seal.to_bytes(c) for c in want], part


def _model(model_dir):
    from engine.loader import load_model

    return load_model(model_dir)
