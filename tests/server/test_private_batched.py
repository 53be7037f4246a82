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
from tests.server.upload_mutations import full_upload_mutations


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


# --- full (unseeded) uploads read straight into device tensors (issue 17, session 13) -------------------------
def _full(client, values) -> bytes:
    from fhe.backends.seal import wire

    return wire.encrypt_to_wire(client, values, seeded=False)


def _seal_parse(lin, keys, blob: bytes):
    """The device ciphertext the SEAL path makes of ``blob`` (SEAL's load, the freshness check, SEAL's save,
    our parse): what the gpu worker did with every upload before."""
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal import wire

    ct = wire.load_ciphertext(blob, keys.kit, keys.fingerprint, level=lin.gpu.top)
    keys.check_input(ct)
    return lin.gpu.deserialize(seal.to_bytes(ct))


def test_a_full_upload_is_parsed_without_seal_into_the_tensors_seal_gives(worker, seal_worker, monkeypatch):
    """A full upload goes straight to the device (SEAL's load is never called for it) as exactly the residues
    and scale the SEAL path gives; so does a seeded one since session 22 (c1 expanded on the device); the answers
    of a one-position and of a chunk step on full uploads are the SEAL worker's, ciphertext for ciphertext."""
    import torch

    from fhe.backends.seal import wire
    from server.private import compute

    rng = np.random.default_rng(4)
    (fp, client), = _sessions((worker, seal_worker), 1)
    lin, keys = worker.linear, worker.linear.keys[fp]
    slots = lin.params.slots
    full = [_full(client, rng.normal(size=slots)) for _ in range(3)]
    seeded = _blob(client, slots, rng)
    want = [_seal_parse(lin, keys, b) for b in (*full, seeded)]
    calls = []
    real = wire.load_ciphertext
    monkeypatch.setattr(compute.wire, "load_ciphertext", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = lin.inputs([*full, seeded], keys, lin.gpu.top)
    assert not calls                                         # the seeded one too: expanded on the device
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.data, w.data) and g.scale == w.scale and g.data.dtype == w.data.dtype
    monkeypatch.undo()
    for part in ("mlp_up", "attn_o"):
        one = [_full(client, np.resize(rng.normal(size=64), slots))]
        assert ([_canonical(worker, fp, b) for b in worker.mlp_step(fp, 0, part, one)] ==
                [_canonical(worker, fp, b) for b in seal_worker.mlp_step(fp, 0, part, one)])
        sh = seal_worker.linear.part(0, part)[0].chunks.shapes[part]
        chunk = [_full(client, v) for v in sh.pack(rng.normal(size=(sh.positions, sh.n_in)))]
        assert ([_canonical(worker, fp, b) for b in worker.mlp_step(fp, 0, part, chunk, True)] ==
                [_canonical(worker, fp, b) for b in seal_worker.mlp_step(fp, 0, part, chunk, True)])


def _mutations(worker, client, blob: bytes) -> dict[str, bytes]:
    """Full uploads that are each wrong in one way SEAL's load or the freshness check refuses."""
    return full_upload_mutations(worker.linear.gpu, client.fingerprint, blob)


def test_malformed_full_uploads_are_refused_as_bad_ciphertext_as_seal_refuses_them(worker, seal_worker):
    """Each malformed full upload is refused by the direct parse (it then goes to SEAL, which refuses it too):
    ``bad_ciphertext`` from the gpu worker, never another exception; the SEAL worker refuses the same bytes
    the same way (a ciphertext not in NTT form included: SEAL's load takes it, the freshness check does not)."""
    from fhe.backends.seal import wire

    rng = np.random.default_rng(5)
    (fp, client), = _sessions((worker, seal_worker), 1)
    lin = worker.linear
    blob = _full(client, rng.normal(size=lin.params.slots))
    seal_takes, payloads = set(), []
    for name, bad in _mutations(worker, client, blob).items():
        with pytest.raises(TaskFailure) as err:
            worker.mlp_step(fp, 0, "mlp_up", [bad])
        assert err.value.code is WorkerCode.BAD_CIPHERTEXT, name
        try:
            seal_worker.mlp_step(fp, 0, "mlp_up", [bad])
            seal_takes.add(name)
        except TaskFailure as exc:
            assert exc.code is WorkerCode.BAD_CIPHERTEXT, name
        try:
            payload = wire.ciphertext_payload(bad, lin.params, client.fingerprint)
        except Exception:    # refused by the envelope already
            continue
        assert lin.gpu.deserialize_fresh(payload) is None, name
        payloads.append(payload)
    assert not seal_takes, seal_takes
    good = wire.ciphertext_payload(blob, lin.params, client.fingerprint)   # a step's uploads at once: the same
    many = lin.gpu.deserialize_fresh_many([good, *payloads, good])
    assert many[0] is not None and many[-1] is not None and not any(many[1:-1])


@pytest.mark.gpu
def test_on_cuda_a_full_upload_is_read_as_the_seal_path_reads_it(worker, seal_worker):
    """On the device: the direct parse of a full upload is the SEAL path's device tensor, residue for residue,
    and each malformed upload is refused by it (None: the worker then asks SEAL, which refuses too)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fhe.backends.gpu.evaluator import GpuEvaluator
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal import wire

    rng = np.random.default_rng(6)
    (fp, client), = _sessions((worker, seal_worker), 1)
    ev = GpuEvaluator(worker.linear.params)
    assert ev.device.type == "cuda"
    for _ in range(3):
        blob = _full(client, rng.normal(size=ev.params.slots))
        got = ev.deserialize_fresh(wire.ciphertext_payload(blob, ev.params, client.fingerprint))
        want = ev.deserialize(seal.to_bytes(wire.load_ciphertext(blob, client.kit, client.fingerprint)))
        assert got.data.device.type == "cuda" and torch.equal(got.data, want.data) and got.scale == want.scale
    for name, bad in _mutations(worker, client, blob).items():
        try:
            payload = wire.ciphertext_payload(bad, ev.params, client.fingerprint)
        except Exception:  # noqa: BLE001 - refused by the envelope already
            continue
        assert ev.deserialize_fresh(payload) is None, name
