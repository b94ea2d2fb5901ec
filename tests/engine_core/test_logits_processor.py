"""The custom logits processor interface: loading classes, and keeping per-request state in step."""

from __future__ import annotations

import pytest
import torch

from engine_core.logits_processor import (
    LOGITS_PROCESSORS_GROUP,
    BatchUpdate,
    LogitsProcessorContext,
    MoveDirectionality,
    load_logits_processors,
    process_dict_updates,
    validate_request_params,
)
from engine_core.sampling_params import SamplingParams
from tests.logits_processors import NoEchoAdapter, OnlyTheBestProcessor, TargetTokenProcessor

CONTEXT = LogitsProcessorContext(model="m", vocab_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                                 max_model_len=32)


def test_classes_load_by_either_qualified_name_or_as_objects_once_each():
    loaded = load_logits_processors(["tests.logits_processors:TargetTokenProcessor",
                                     "tests.logits_processors.OnlyTheBestProcessor", NoEchoAdapter,
                                     TargetTokenProcessor], with_entry_points=False)
    assert loaded == (TargetTokenProcessor, OnlyTheBestProcessor, NoEchoAdapter)
    assert load_logits_processors([], with_entry_points=False) == ()


@pytest.mark.parametrize(("spec", "words"), [
    ("tests.logits_processors:NotAProcessor", "is not a subclass"),
    ("tests.logits_processors:Missing", "cannot be loaded"),
    ("no_such_package.module:Class", "cannot be loaded"),
    ("Bare", "not a qualified class name"),
    ("engine_core.logits_processor:AdapterLogitsProcessor", "is abstract"),
])
def test_what_is_not_a_usable_processor_is_refused_by_name(spec, words):
    with pytest.raises(ValueError, match=words):
        load_logits_processors([spec], with_entry_points=False)


def test_installed_packages_offer_processors_through_the_entry_point_group(tmp_path, monkeypatch):
    # A distribution on sys.path whose metadata names a processor in the group, as pip installs it.
    dist = tmp_path / "lp_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lp-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{LOGITS_PROCESSORS_GROUP}]\nbest = tests.logits_processors:OnlyTheBestProcessor\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_logits_processors([TargetTokenProcessor]) == (OnlyTheBestProcessor, TargetTokenProcessor)
    assert load_logits_processors([TargetTokenProcessor], with_entry_points=False) == (TargetTokenProcessor,)
    (dist / "entry_points.txt").write_text(f"[{LOGITS_PROCESSORS_GROUP}]\nbad = tests.logits_processors:Nope\n")
    with pytest.raises(ValueError, match="entry point 'bad'"):
        load_logits_processors([])


def test_validate_params_refuses_a_request_with_the_processors_reason():
    classes = (TargetTokenProcessor,)
    validate_request_params(classes, SamplingParams(extra_args={"target_token": 3}))
    validate_request_params(classes, SamplingParams())
    with pytest.raises(ValueError, match="target_token must be a non-negative integer"):
        validate_request_params(classes, SamplingParams(extra_args={"target_token": "three"}))


def test_extra_args_must_be_a_mapping_with_string_keys():
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args={1: "x"})  # type: ignore[dict-item]


def _params(tag: str | None) -> SamplingParams:
    return SamplingParams(extra_args=None if tag is None else {"tag": tag})


def test_dict_updates_apply_removed_then_added_then_moved():
    entries: dict[int, str] = {0: "a", 1: "b", 2: "c", 3: "d"}

    def tag(params, _prompt, _out):
        return (params.extra_args or {}).get("tag")

    # b leaves and e takes its index; d leaves; c moves down to 2 -> stays; then a and c swap.
    update = BatchUpdate(batch_size=3, removed=[3], added=[(1, _params("e"), [1], [])],
                         moved=[(0, 2, MoveDirectionality.SWAP)])
    assert process_dict_updates(entries, update, tag)
    assert entries == {0: "c", 1: "e", 2: "a"}
    # An added request the processor ignores clears what was at its index; a one-way move leaves a gap.
    update = BatchUpdate(batch_size=2, removed=[], added=[(1, _params(None), [1], [])],
                         moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)])
    assert process_dict_updates(entries, update, tag)
    assert entries == {0: "c", 1: "a"}
    assert not process_dict_updates(entries, None, tag)
    assert not process_dict_updates({}, BatchUpdate(batch_size=1, removed=[0], added=[], moved=[]), tag)


def test_the_adapter_runs_each_requests_function_on_its_row_with_live_output_ids():
    adapter = NoEchoAdapter(CONTEXT, torch.device("cpu"), False)
    outputs: list[int] = []
    adapter.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[
        (0, SamplingParams(extra_args={"no_echo": True}), [1, 2], outputs),
        (1, SamplingParams(), [3], [])]))
    assert list(adapter.req_info) == [0]
    logits = torch.zeros(2, 8)
    out = adapter.apply(logits)
    assert torch.isinf(out[0, [1, 2]]).all() and torch.isfinite(out[0, [0, 3, 4, 5, 6, 7]]).all()
    assert torch.isfinite(out[1]).all()
    outputs.append(5)  # (the request sampled 5: the function sees it at the next step)
    adapter.update_state(None)
    assert torch.isinf(adapter.apply(torch.zeros(2, 8))[0, 5])


def test_an_engine_refuses_processors_it_could_not_honour():
    from engine_core.config import EngineConfig, SpeculativeConfig

    assert EngineConfig(model="m", logits_processors=(TargetTokenProcessor, "a.b:C")).logits_processors
    with pytest.raises(ValueError, match="logits_processors must be unset with speculative decoding"):
        EngineConfig(model="m", logits_processors=("a.b:C",),
                     speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    with pytest.raises(ValueError, match="logits_processors must be classes or qualified class names"):
        EngineConfig(model="m", logits_processors=(3,))


def test_any_failure_to_import_or_to_validate_is_reported_as_a_refusal(tmp_path, monkeypatch):
    (tmp_path / "broken_processors.py").write_text("raise RuntimeError('no GPU library here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="cannot be loaded: RuntimeError: no GPU library here"):
        load_logits_processors(["broken_processors:Anything"], with_entry_points=False)

    class Sloppy(TargetTokenProcessor):
        @classmethod
        def validate_params(cls, sampling_params):
            return sampling_params.extra_args["needed"]  # (a KeyError when it is missing)

    with pytest.raises(ValueError, match=r"Sloppy\.validate_params: KeyError"):
        validate_request_params((Sloppy,), SamplingParams(extra_args={}))
