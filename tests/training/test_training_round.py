"""Rounds: every input changes the digest, replay agrees or names the first differing step,
and the published adapter loads with peft and gives the same logits."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from blobstore import Store  # noqa: E402
from identity import MachineKey, SoftwareSigner  # noqa: E402
from training import determinism  # noqa: E402
from training.errors import DeviceUnavailable, ReplayMismatch  # noqa: E402
from training.kernel_class import KernelClass  # noqa: E402
from training.model import load_base_model, make_tiny_llama, save_base_model  # noqa: E402
from training.records import make_records  # noqa: E402
from training.rounds.commitment import REPLAY_KIND, Commitment, RoundRecord  # noqa: E402
from training.rounds.recipe import Recipe  # noqa: E402
from training.rounds.round import RoundInputs, execute, replay_round, run_round  # noqa: E402

TEXT = b"the quick brown fox jumps over the lazy dog. " * 12
RECIPE = Recipe(steps=4, batch_size=4, seq_len=32)
SEED = 11


@dataclasses.dataclass
class World:
    store: Store
    base_id: str
    records_id: str
    tmp: Path
    signer: SoftwareSigner


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    determinism.enter("cpu", threads=1)
    tmp = tmp_path_factory.mktemp("round")
    store = Store.open(tmp / "store")
    save_base_model(make_tiny_llama("tiny", seed=0), tmp / "base")
    base_id = store.put_dir(tmp / "base")
    records_id = store.put_bytes(make_records([TEXT], RECIPE.seq_len))
    return World(store, base_id, records_id, tmp, SoftwareSigner(MachineKey.generate()))


@pytest.fixture(scope="module")
def baseline(world: World) -> Commitment:
    return execute(
        world.store, RoundInputs(world.base_id, world.records_id, RECIPE, SEED), device="cpu"
    )


def test_same_inputs_same_digest_in_one_process(world: World, baseline: Commitment) -> None:
    again = execute(
        world.store, RoundInputs(world.base_id, world.records_id, RECIPE, SEED), device="cpu"
    )
    assert again.digest == baseline.digest
    assert len(baseline.step_log) == RECIPE.steps
    assert baseline.start_root != baseline.end_root


def _other_base(world: World) -> str:
    model = make_tiny_llama("tiny", seed=0)
    with torch.no_grad():
        w = model.model.layers[0].mlp.down_proj.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))  # one weight, one ulp
    save_base_model(model, world.tmp / "base-1ulp")
    return world.store.put_dir(world.tmp / "base-1ulp")


def _other_records(world: World) -> str:
    flipped = bytearray(TEXT)
    flipped[100] ^= 1  # one token
    return world.store.put_bytes(make_records([bytes(flipped)], RECIPE.seq_len))


@pytest.mark.parametrize("change", ["token", "lr", "seed", "steps", "base_weight"])
def test_any_single_input_changes_the_digest(
    world: World, baseline: Commitment, change: str
) -> None:
    inputs = RoundInputs(world.base_id, world.records_id, RECIPE, SEED)
    if change == "token":
        inputs = dataclasses.replace(inputs, records_id=_other_records(world))
    elif change == "lr":
        inputs = dataclasses.replace(inputs, recipe=dataclasses.replace(RECIPE, lr=1.01e-3))
    elif change == "seed":
        inputs = dataclasses.replace(inputs, seed=SEED + 1)
    elif change == "steps":
        inputs = dataclasses.replace(inputs, recipe=dataclasses.replace(RECIPE, steps=5))
    else:
        inputs = dataclasses.replace(inputs, base_id=_other_base(world))
    other = execute(world.store, inputs, device="cpu")
    assert other.digest != baseline.digest
    if change in ("token", "base_weight", "lr"):
        # not only the recorded ID: the training itself diverged
        assert other.end_root != baseline.end_root


def test_no_cuda_and_no_explicit_cpu_refuses_the_load(world: World) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without CUDA")
    with pytest.raises(DeviceUnavailable, match="--device cpu"):
        execute(world.store, RoundInputs("0" * 64, "1" * 64, RECIPE, SEED))


def test_replay_agrees_and_names_the_first_differing_step(world: World) -> None:
    inputs = RoundInputs(world.base_id, world.records_id, RECIPE, SEED)
    result = run_round(world.store, inputs, world.signer, now=time.time(), device="cpu")
    replay = replay_round(world.store, result.round_id, world.signer, now=time.time())
    assert replay.attestation.digest == result.commitment.digest
    assert replay.attestation.kind == REPLAY_KIND  # the kind only a replay signs
    assert replay.attestation.subjects[0] == result.round_id

    log = list(result.commitment.step_log)
    log[2] ^= 1  # a record claiming another loss at step 2
    forged = dataclasses.replace(result.commitment, step_log=tuple(log))
    forged_id = world.store.put_bytes(
        RoundRecord(forged, RECIPE, result.record.attestation).encode()
    )
    with pytest.raises(ReplayMismatch, match="differs first at step 2"):
        replay_round(world.store, forged_id, world.signer, now=time.time())

    swapped = dataclasses.replace(result.commitment, adapter_id="a" * 64)
    swapped_id = world.store.put_bytes(
        RoundRecord(swapped, RECIPE, result.record.attestation).encode()
    )
    with pytest.raises(ReplayMismatch, match="adapter"):
        replay_round(world.store, swapped_id, world.signer, now=time.time())


def test_replay_refuses_another_kernel_class(world: World, baseline: Commitment) -> None:
    """A round from another CPU capability is refused, whatever this host's capability is."""
    ours = str(baseline.kernel_class.fields["cpu_capability"])
    theirs = "AVX2" if ours != "AVX2" else "AVX512"
    fields = {**baseline.kernel_class.fields, "cpu_capability": theirs}
    other = dataclasses.replace(baseline, kernel_class=KernelClass.from_fields(fields))
    round_id = world.store.put_bytes(RoundRecord(other, RECIPE, b"").encode())
    expected = re.escape(f"cpu_capability={ours!r} (round: {theirs!r})")
    with pytest.raises(ReplayMismatch, match=expected):
        replay_round(world.store, round_id, world.signer, now=time.time())


def test_adapter_loads_with_peft_and_gives_the_same_logits(
    world: World, baseline: Commitment
) -> None:
    import warnings

    from peft import PeftModel

    from training.records import decode_records
    from training.rounds import trainer

    records = decode_records(world.store.path(world.records_id).read_bytes())
    session = trainer.prepare(make_tiny_llama("tiny", seed=0), RECIPE, SEED, "cpu")
    trainer.run_steps(session, records)
    assert trainer.state_root(session) == baseline.end_root

    world.store.export(baseline.adapter_id, world.tmp / "adapter")
    world.store.export(world.base_id, world.tmp / "base-export")
    with warnings.catch_warnings():
        # peft 0.21 probes a transformers 5 attribute that warns it is deprecated
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        loaded = PeftModel.from_pretrained(
            load_base_model(world.tmp / "base-export"), str(world.tmp / "adapter")
        )
    loaded.eval()
    session.model.eval()
    ids = torch.from_numpy(records.tokens[:2].copy())
    with torch.no_grad():
        want = session.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(want, got)
    assert not torch.equal(got, make_tiny_llama("tiny", seed=0)(input_ids=ids).logits)


def test_a_math_setting_changed_during_the_round_refuses_it(world: World) -> None:
    """Flush-to-zero switched on after step 1: the class re-detected after the last step
    differs from the one at the start, so the round is refused, not published."""
    from training.errors import AuditViolation

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode torch can set")

    def flip(step: int, bits: int) -> None:
        if step == 1:
            torch.set_flush_denormal(True)

    before = set(world.store.blob_ids())
    try:
        with pytest.raises(AuditViolation, match="flush_denormal changed while it trained"):
            execute(
                world.store,
                RoundInputs(world.base_id, world.records_id, RECIPE, SEED),
                device="cpu",
                on_step=flip,
            )
    finally:
        torch.set_flush_denormal(False)
    assert set(world.store.blob_ids()) == before
