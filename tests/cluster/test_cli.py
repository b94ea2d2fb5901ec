"""`llm-cluster serve` flags down to the engine configs and the router deployment (no Ray needed)."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from cluster.app import router_deployment
from cluster.cli import build_parser, cluster_config_from_args, main, served_models_line
from cluster.config import ClusterConfig, EngineSpec
from cluster.launcher import engine_actor_name
from engine_core.config import KV_CACHE_DTYPE_NAMES, MAMBA_CACHE_DTYPE_NAMES, MAMBA_CACHE_MODE_NAMES, EngineConfig


def _config(*flags: str):
    return cluster_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_scheduler_and_engine_flags_reach_every_engine():
    config = _config("--num-engines", "2", "--max-num-seqs", "8", "--long-prefill-token-threshold", "64",
                     "--engine-niceness", "2", "--no-enable-prefix-caching", "--scheduling-policy", "priority")
    engines = config.engine_configs()
    assert len(engines) == 2
    for engine in engines:
        assert engine.scheduler.max_num_seqs == 8 and engine.scheduler.long_prefill_token_threshold == 64
        assert engine.engine_niceness == 2 and not engine.enable_prefix_caching
        assert engine.scheduler.policy == "priority"


def test_the_access_log_is_on_unless_disabled():
    assert router_deployment(_config())._bound_deployment.logging_config["enable_access_log"] is True
    quiet = _config("--disable-access-log", "--num-router-replicas", "2")
    deployment = router_deployment(quiet)._bound_deployment  # the deployment behind the bound application
    assert deployment.logging_config["enable_access_log"] is False and deployment.num_replicas == 2


@pytest.mark.parametrize(("flags", "files", "message"), [
    (["--num-engines", "0"], {}, "--num-engines: Input should be greater than or equal to 1"),
    (["--port", "70000"], {}, "--port: Input should be less than or equal to 65535"),
    (["--request-timeout", "0"], {}, "--request-timeout: Input should be greater than 0"),
    (["--max-num-seqs", "0"], {}, "max_num_seqs must be >= 1"),
    (["--engine-config", "{missing}"], {}, "No such file or directory"),
    (["--engine-config", "{file}"], {"file": "- 5\n"}, "expected a YAML list of per-engine mappings"),
    (["--engine-config", "{file}"], {"file": "- {max_num_sqs: 4}\n"}, "max_num_sqs"),
    (["--num-engines", "1", "--engine-config", "{file}"], {"file": "- {}\n- {}\n"},
     "engines has 2 per-engine entries but num_engines is 1"),
    (["--model", "{missing}"], {}, "neither an existing path nor a known model name"),
    (["--model", "{file}"], {"file": "not a model"}, "is not a .gguf file"),
    (["--enable-auto-tool-choice"], {}, "enable_auto_tool_choice needs tool_call_parser"),
    (["--api-key", ""], {}, "api_keys must not be empty strings"),
    (["--chat-template", "{missing}"], {}, "--chat-template: no such file"),
    (["--speculative-config", '{{"method": "medusa", "num_speculative_tokens": 2}}'], {},
     "speculative_config.method must be one of ngram, suffix, draft_model"),
    (["--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 0}}'], {},
     "speculative_config.num_speculative_tokens must be given, and >= 1"),
    (["--lora-modules", "a=/x"], {}, "lora_modules need enable_lora"),
    (["--allow-runtime-lora-updating"], {}, "allow_runtime_lora_updating needs enable_lora"),
    (["--enable-lora", "--lora-modules", "a"], {}, "--lora-modules: expected name=path, got 'a'"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], {}, "the name 'a' is given twice"),
    (["--enable-lora", "--lora-modules", '{{"name": "a", "path": "/x", "base_model": "m"}}'], {},
     "--lora-modules: unknown keys ['base_model']"),
    (["--enable-lora", "--lora-modules", "a={missing}"], {}, "No adapter found at"),
    (["--enable-lora", "--max-loras", "0"], {}, "--max-loras: Input should be greater than or equal to 1"),
    (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], {},
     "max_cpu_loras (--max-cpu-loras, 1) must be at least max_loras (--max-loras, 2)"),
    (["--engine-config", "{file}"], {"file": "- {kv_cache_dtype: int8}\n"}, "kv_cache_dtype"),
    (["--enable-responses-store", "--responses-store-max-entries", "0"], {},
     "--responses-store-max-entries: Input should be greater than or equal to 1"),
    (["--stream-interval", "0"], {}, "--stream-interval: Input should be greater than or equal to 1"),
    (["-pp", "0"], {}, "--pipeline-parallel-size: Input should be greater than or equal to 1"),
    (["--extra-models", "{file}"], {"file": "model: x\n"}, "expected a YAML list of model mappings"),
    (["--extra-models", "{file}"], {"file": "- {model: x, num_engine: 2}\n"}, "model 0: num_engine"),
    (["--served-model-name", "tiny", "--extra-models", "{file}"], {"file": "- {model: x, served_model_name: tiny}\n"},
     "two served models are named 'tiny'"),
    (["--extra-models", "{file}"], {"file": "- {model: x, tool_call_parser: nope}\n"},
     "models[x].tool_call_parser must be one of"),
    (["--extra-models", "{file}"], {"file": "- {model: x, num_engines: 1, engines: [{}, {}]}\n"},
     "models[x].engines has 2 per-engine entries but num_engines is 1"),
    (["--extra-models", "{file}"], {"file": "- {model: x}\n"}, "model 'x' not found"),
    (["--generation-config", "{missing}"], {}, "is not a folder"),
    (["--override-generation-config", '{{"temperature": -1}}'], {},
     "override_generation_config: temperature must be finite and >= 0"),
    # vLLM's flags for what is not built here: refused with why.
    (["--revision", "main"], {}, "--revision: models are local directories"),
    (["-q", "fp8"], {}, "-q: a checkpoint's own quantization"),
    (["--ssl-keyfile", "k.pem"], {}, "--ssl-keyfile: TLS ends in front of Ray Serve's proxy"),
    (["--kv-transfer-config", '{{"kv_connector": "OffloadingConnector"}}'], {}, "pass --kv-offloading-size GIB"),
    (["/models/a", "--model", "/models/b"], {}, "two models: '/models/a' and --model '/models/b'"),
    (["--api-key", "k", "/models/a"], {}, "an --api-key value looks like a model path: give the model first"),
])
def test_bad_configuration_stops_with_one_line_and_status_2(tmp_path, capsys, flags, files, message):
    paths = {"missing": str(tmp_path / "missing.yaml")}
    for key, text in files.items():
        (tmp_path / f"{key}.yaml").write_text(text)
        paths[key] = str(tmp_path / f"{key}.yaml")
    assert main(["serve", *(f.format(**paths) for f in flags)]) == 2  # before Ray starts
    err = capsys.readouterr().err.strip()
    assert err.startswith("llm-cluster: ") and message in err and "\n" not in err


def test_tool_calling_flags_and_the_chat_template_reach_the_router(tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    [router] = router_deployment(_config("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                         "--chat-template", str(template), "--reasoning-parser", "qwen3")
                                 )._bound_deployment.init_args
    assert router.tool_call_parser == "hermes" and router.chat_template == template.read_text()
    assert router.reasoning_parser == "qwen3"
    # Without --enable-auto-tool-choice the parser alone does not enable "auto" (as in vLLM).
    [plain] = router_deployment(_config("--tool-call-parser", "hermes"))._bound_deployment.init_args
    assert plain.tool_call_parser is None and plain.chat_template is None
    # A template given inline (not a file), as vLLM also takes it.
    [inline] = router_deployment(_config("--chat-template", "{{ messages[0]['content'] }}"))._bound_deployment.init_args
    assert inline.chat_template == "{{ messages[0]['content'] }}"
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, "granite"])


def test_api_keys_come_from_the_flag_or_the_environment(monkeypatch):
    [router] = router_deployment(_config("--api-key", "a", "--api-key", "b"))._bound_deployment.init_args
    assert router.api_keys == ("a", "b")
    monkeypatch.setenv("LLM_CLUSTER_API_KEY", "from-env")
    [router] = router_deployment(_config())._bound_deployment.init_args
    assert router.api_keys == ("from-env",)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")  # ours first, then vLLM's variable
    assert router_deployment(_config())._bound_deployment.init_args[0].api_keys == ("from-env",)
    monkeypatch.delenv("LLM_CLUSTER_API_KEY")
    assert router_deployment(_config())._bound_deployment.init_args[0].api_keys == ("from-vllm",)
    monkeypatch.delenv("VLLM_API_KEY")
    assert router_deployment(_config())._bound_deployment.init_args[0].api_keys == ()


def test_the_override_list_sets_the_engine_count_when_num_engines_is_not_given(tmp_path):
    from cluster.config import ClusterConfig

    assert len(ClusterConfig(engines=[{}, {"max_num_seqs": 4}]).engine_configs()) == 2
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {max_num_seqs: 4}\n")
    engines = _config("--engine-config", str(overrides)).engine_configs()  # (the CLI too)
    assert [e.scheduler.max_num_seqs for e in engines] == [256, 4]
    assert len(_config().engine_configs()) == 1


def test_prefix_aware_routing_needs_one_block_size_per_model():
    """The router hashes a prompt's blocks at its model's block size: an engine of another size would
    never match what it caches."""
    mixed = {"engines": [{}, {"block_size": 32}]}
    assert len(ClusterConfig(routing_policy="least_loaded", **mixed).engine_configs()) == 2
    with pytest.raises(ValueError, match="engine 1: block_size 32 differs from engine 0's 16"):
        ClusterConfig(routing_policy="prefix_aware", **mixed).engine_configs()
    same = ClusterConfig(routing_policy="prefix_aware", defaults={"block_size": 32}, engines=[{}, {}])
    assert [e.block_size for e in same.engine_configs()] == [32, 32]


def test_vllms_spelling_of_the_block_count_flag_is_accepted():
    [engine] = _config("--num-gpu-blocks-override", "96").engine_configs()
    assert engine.num_gpu_blocks == 96


def test_speculative_config_reaches_the_engines_and_can_differ_per_engine(tmp_path):
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {speculative_config: null}\n- {speculative_config: {num_speculative_tokens: 5}}\n"
                         "- {speculative_config: {}}\n")
    config = _config("--num-engines", "4", "--engine-config", str(overrides),
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}')
    engines = config.engine_configs()
    spec = engines[0].speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 2, 4, 4)
    # An override replaces the whole mapping; null in YAML inherits the default.
    assert engines[1].speculative_config == spec
    assert engines[2].speculative_config.num_speculative_tokens == 5
    assert engines[2].speculative_config.prompt_lookup_max == 5
    assert engines[3].speculative_config is None  # {} turns it off for one engine
    assert _config().engine_configs()[0].speculative_config is None


def test_lora_flags_reach_every_engine_and_the_router(monkeypatch):
    config = _config("--num-engines", "2", "--enable-lora", "--lora-modules", "sql=/adapters/sql",
                     '{"name": "chat", "path": "/adapters/chat"}', "--max-loras", "3", "--max-lora-rank", "64",
                     "--max-cpu-loras", "5")
    for engine in config.engine_configs():
        lora = engine.lora_config
        assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (3, 64, 5)
        assert [(m.name, m.path) for m in lora.lora_modules] == [("sql", "/adapters/sql"), ("chat", "/adapters/chat")]
    assert router_deployment(config)._bound_deployment.init_args[0].allow_runtime_lora_updating is False
    assert _config().engine_configs()[0].lora_config is None
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's switch for the load endpoints
    updating = _config("--enable-lora")
    assert router_deployment(updating)._bound_deployment.init_args[0].allow_runtime_lora_updating is True
    assert ClusterConfig(model="m", enable_lora=True).allow_runtime_lora_updating is True  # (a Serve config too)
    # Exported image-wide, the switch does not stop a server without adapters from starting; the flag
    # given without --enable-lora is still refused.
    assert _config().allow_runtime_lora_updating is False
    assert ClusterConfig(model="m").allow_runtime_lora_updating is False
    assert main(["serve", "--allow-runtime-lora-updating"]) == 2  # (before Ray starts)


def test_server_dev_mode_reaches_the_router_from_the_flag_or_vllms_variable(monkeypatch):
    def dev_mode(config):
        return router_deployment(config)._bound_deployment.init_args[0].server_dev_mode

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert dev_mode(_config()) is False
    assert dev_mode(_config("--server-dev-mode")) is True
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert dev_mode(_config()) is True
    assert ClusterConfig(model="m").server_dev_mode is True  # (a Serve config's default, too)


def test_enable_sleep_mode_reaches_every_engine():
    configs = _config("--enable-sleep-mode", "--num-engines", "2").engine_configs()
    assert [c.enable_sleep_mode for c in configs] == [True, True]
    assert _config().engine_configs()[0].enable_sleep_mode is False


def test_vllms_server_route_flags_reach_the_router():
    def routes(*flags):
        config = router_deployment(_config(*flags))._bound_deployment.init_args[0]
        return config.enable_server_load_tracking, config.enable_tokenizer_info_endpoint

    assert routes() == (False, False)
    assert routes("--enable-server-load-tracking") == (True, False)
    assert routes("--enable-tokenizer-info-endpoint") == (False, True)


def test_max_cpu_loras_defaults_to_max_loras_as_in_vllm():
    assert _config("--enable-lora", "--max-loras", "3").engine_configs()[0].lora_config.max_cpu_loras == 3
    assert _config("--enable-lora").engine_configs()[0].lora_config.max_cpu_loras == 1


def test_a_serve_configs_chat_template_path_is_read_as_the_cli_reads_it(tmp_path):
    """The Serve config's chat_template (and each models[] entry's) is a file or the template, as
    --chat-template is: a path was taken as the template's text (every prompt was the path)."""
    from cluster.config import read_chat_template_files

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = {"model": "/models/a", "chat_template": str(template),
            "models": [{"model": "/models/b", "chat_template": "{{ messages }}"},
                       {"model": "/models/c", "chat_template": str(template)}]}
    config = ClusterConfig(**read_chat_template_files(args))
    assert [config.chat_template, *(m.chat_template for m in config.models)] == [
        template.read_text(), "{{ messages }}", template.read_text()]
    assert args["chat_template"] == str(template)  # (the mapping given is left as it was)
    with pytest.raises(ValueError, match=r"models\[0\].chat_template: no such file: /nowhere.jinja"):
        read_chat_template_files({"model": "/models/a", "models": [{"model": "b", "chat_template": "/nowhere.jinja"}]})
    for bad in ({"chat_template": "/nowhere.jinja"}, {"models": [{"model": "b", "chat_template": "t.jinja"}]}):
        with pytest.raises(ValueError, match="is no Jinja template"):  # (a config made without reading paths)
            ClusterConfig(model="/models/a", **bad)


def test_trusting_request_chat_templates_reaches_every_models_router(tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text("- {model: /models/b, served_model_name: b}\n")

    def trusted(*flags):
        first, more = router_deployment(_config("--extra-models", str(models), *flags))._bound_deployment.init_args
        return [c.trust_request_chat_template for c in (first, *more)]

    assert trusted() == [False, False]
    assert trusted("--trust-request-chat-template") == [True, True]


def test_the_kv_cache_dtype_reaches_every_engine_and_can_differ_per_engine(tmp_path):
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {kv_cache_dtype: auto}\n")
    engines = _config("--num-engines", "2", "--kv-cache-dtype", "fp8", "--engine-config", str(overrides)
                      ).engine_configs()
    assert [e.kv_cache_dtype for e in engines] == ["fp8", "auto"]
    assert _config().engine_configs()[0].kv_cache_dtype == "auto"
    # The Serve config's field takes exactly the names the engines (and vLLM's flag) take.
    assert get_args(get_args(EngineSpec.model_fields["kv_cache_dtype"].annotation)[0]) == KV_CACHE_DTYPE_NAMES
    with pytest.raises(ValueError, match="engine 0: kv_cache_dtype must be one of auto, bfloat16, fp8"):
        EngineConfig(kv_cache_dtype="int8")


def test_the_recurrent_state_dtypes_reach_every_engine_and_can_differ_per_engine(tmp_path):
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {mamba_ssm_cache_dtype: float32}\n")
    engines = _config("--num-engines", "2", "--mamba-ssm-cache-dtype", "bfloat16", "--mamba-cache-dtype", "float16",
                      "--engine-config", str(overrides)).engine_configs()
    assert [(e.mamba_cache_dtype, e.mamba_ssm_cache_dtype) for e in engines] == [("float16", "bfloat16"),
                                                                                 ("float16", "float32")]
    assert (_config().engine_configs()[0].mamba_cache_dtype, _config().engine_configs()[0].mamba_ssm_cache_dtype) \
        == ("auto", "auto")
    assert get_args(get_args(EngineSpec.model_fields["mamba_ssm_cache_dtype"].annotation)[0]) == MAMBA_CACHE_DTYPE_NAMES
    with pytest.raises(ValueError, match="engine 0: mamba_ssm_cache_dtype must be one of auto, float32, float16, "
                                         "bfloat16"):
        EngineConfig(mamba_ssm_cache_dtype="fp8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mamba-cache-dtype", "int8"])


def test_the_recurrent_state_prefix_cache_flags_reach_every_engine_and_can_differ_per_engine(tmp_path):
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {mamba_cache_mode: none}\n- {mamba_prefix_cache_slots: 3}\n")
    engines = _config("--num-engines", "3", "--mamba-cache-mode", "align", "--max-num-seqs", "6",
                      "--engine-config", str(overrides)).engine_configs()
    assert [(e.mamba_cache_mode, e.recurrent_state_slots) for e in engines] == [("align", 6), ("none", 0),
                                                                                ("align", 3)]
    assert _config().engine_configs()[0].mamba_cache_mode == "none"
    # (Without prefix caching no state is kept, whatever the mode.)
    assert _config("--mamba-cache-mode", "align", "--no-enable-prefix-caching").engine_configs()[0] \
        .recurrent_state_slots == 0
    assert get_args(get_args(EngineSpec.model_fields["mamba_cache_mode"].annotation)[0]) == MAMBA_CACHE_MODE_NAMES
    with pytest.raises(ValueError, match="engine 0: mamba_cache_mode must be one of none, align"):
        EngineConfig(mamba_cache_mode="all")
    with pytest.raises(ValueError, match="engine 0: mamba_prefix_cache_slots must be None or >= 1"):
        EngineConfig(mamba_prefix_cache_slots=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mamba-cache-mode", "all"])


def test_the_responses_store_is_off_unless_asked_for(monkeypatch):
    def router_config(*flags):
        return router_deployment(_config(*flags))._bound_deployment.init_args[0]

    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    assert router_config().enable_responses_store is False
    on = router_config("--enable-responses-store", "--responses-store-max-entries", "500")
    assert on.enable_responses_store is True and on.responses_store_max_entries == 500
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")  # vLLM's switch
    assert router_config().enable_responses_store is True
    assert router_config().enable_prompt_tokens_details is False
    assert router_config("--enable-prompt-tokens-details").enable_prompt_tokens_details is True


def test_the_stream_interval_reaches_the_router():
    def router_config(*flags):
        return router_deployment(_config(*flags))._bound_deployment.init_args[0]

    assert router_config().stream_interval == 1  # vLLM's default: every engine step's tokens
    assert router_config("--stream-interval", "8").stream_interval == 8


def test_extra_models_get_engines_of_their_own_after_the_first_models(tmp_path):
    models = tmp_path / "models.yaml"
    (tmp_path / "c.jinja").write_text("{{ messages }}")  # a file, as --chat-template takes it
    models.write_text("- {model: /models/b, served_model_name: b, num_engines: 2, defaults: {max_num_seqs: 4},\n"
                      "   engines: [{}, {max_num_seqs: 2}], reasoning_parser: qwen3}\n"
                      "- {model: /models/c, served_model_name: c, enable_auto_tool_choice: true,\n"
                      "   tool_call_parser: hermes, chat_template: c.jinja}\n")  # (beside the YAML file)
    config = _config("--served-model-name", "tiny", "--num-engines", "2", "--max-num-seqs", "8",
                     "--block-size", "32", "--extra-models", str(models), "--tool-call-parser", "mistral")
    engines = config.engine_configs()
    assert [(e.engine_index, e.model, e.served_model_name) for e in engines] == [
        (0, "SmolLM2-135M-Instruct", "tiny"), (1, "SmolLM2-135M-Instruct", "tiny"), (2, "/models/b", "b"),
        (3, "/models/b", "b"), (4, "/models/c", "c")]
    # The cluster's flags, then the model's defaults, then its per-engine entries.
    assert [e.scheduler.max_num_seqs for e in engines] == [8, 8, 4, 2, 8]
    assert {e.block_size for e in engines} == {32}
    first, more = router_deployment(config)._bound_deployment.init_args
    assert first.engine_actor_names == [engine_actor_name(0), engine_actor_name(1)] and first.engine_indexes == (0, 1)
    assert first.tool_call_parser is None  # the first model's "auto" is not enabled
    b, c = more
    assert b.engine_actor_names == [engine_actor_name(2), engine_actor_name(3)] and b.engine_indexes == (2, 3)
    assert (b.served_model_name, b.reasoning_parser, b.tool_call_parser) == ("b", "qwen3", None)
    assert (c.served_model_name, c.tool_call_parser, c.chat_template) == ("c", "hermes", "{{ messages }}")
    assert c.engine_actor_names == [engine_actor_name(4)] and not c.enable_lora


def test_engine_layout_keeps_running_engines_where_they_are():
    from cluster.config import engine_layout

    assert engine_layout([["a", "a"], ["b"], ["c"] * 3], []) == [[0, 1], [2], [3, 4, 5]]  # nothing runs: in order
    # The first model grows from 1 to 2: the others keep their indexes, its new slot takes the first free one.
    assert engine_layout([["a", "a"], ["b"], ["c"]], [{0: "a"}, {1: "b"}, {2: "c"}]) == [[0, 3], [1], [2]]
    # It shrinks again: the engine kept is the lowest of those running what the slot runs.
    assert engine_layout([["a"], ["b"], ["c"]], [{0: "a", 3: "a"}, {1: "b"}, {2: "c"}]) == [[0], [1], [2]]
    # A model removed: its index is free for the others' new slots.
    assert engine_layout([["a"], ["c", "c"]], [{0: "a"}, {2: "c"}]) == [[0], [2, 1]]
    # Per-engine flags: each engine keeps the slot whose flags it runs, whichever others died (engine
    # 0, "x", is gone: its slot takes a free index, and engines 1 and 2 keep theirs).
    assert engine_layout([["x", "y", "z"], ["b"]], [{1: "y", 2: "z"}, {3: "b"}]) == [[0, 1, 2], [3]]
    assert engine_layout([["x", "y", "z"]], [{5: "z", 7: "x"}]) == [[7, 0, 5]]
    # An engine whose flags changed keeps its index in a slot left (it is replaced there).
    assert engine_layout([["x2", "y"]], [{0: "x", 1: "y"}]) == [[0, 1]]


def test_place_engines_numbers_each_models_slots_by_its_running_engines():
    """A redeploy raising the first model's engines must not move the second model's (engine names
    and metric labels follow, and the reconciler would replace engines found at new indexes)."""
    import dataclasses

    def config(first_engines: int) -> ClusterConfig:
        return ClusterConfig(model="/models/a", served_model_name="a", num_engines=first_engines, models=[
            {"model": "/models/b", "served_model_name": "b", "num_engines": 2}])

    before = {e.engine_index: e for e in config(1).engine_configs()}  # a at 0, b at 1 and 2
    grown = config(2)
    grown.place_engines(before)
    assert [(e.engine_index, e.served_model_name) for e in grown.engine_configs()] == [
        (0, "a"), (3, "a"), (1, "b"), (2, "b")]
    first, (b,) = router_deployment(grown)._bound_deployment.init_args
    assert first.engine_indexes == (0, 3) and first.engine_actor_names == [engine_actor_name(0), engine_actor_name(3)]
    assert b.engine_indexes == (1, 2)
    # Per-engine flags follow their slots: an engine running slot 1's flags at index 4 and one running
    # slot 0's at 9 each keep their index in their own slot.
    pinned = ClusterConfig(model="/models/a", served_model_name="a",
                           engines=[{"max_num_seqs": 8}, {"max_num_seqs": 16}])
    one, two = pinned.engine_configs()
    pinned.place_engines({4: dataclasses.replace(two, engine_index=4), 9: dataclasses.replace(one, engine_index=9)})
    assert [(e.engine_index, e.scheduler.max_num_seqs) for e in pinned.engine_configs()] == [(9, 8), (4, 16)]


def test_each_model_has_adapters_of_its_own(tmp_path):
    """An extra model's LoRA settings reach its engines and router alone; the runtime endpoints serve
    the models with adapters; a client names a model or an adapter alike, so the names are unique."""
    models = tmp_path / "models.yaml"
    models.write_text("- {model: /models/b, served_model_name: b, enable_lora: true, max_loras: 2,\n"
                      "   lora_modules: [b-sql=/adapters/b-sql]}\n- {model: /models/c, served_model_name: c}\n")
    config = _config("--served-model-name", "tiny", "--extra-models", str(models), "--allow-runtime-lora-updating")
    first, b, c = (e.lora_config for e in config.engine_configs())
    assert first is None and c is None
    assert (b.max_loras, [(m.name, m.path) for m in b.lora_modules]) == (2, [("b-sql", "/adapters/b-sql")])
    tiny_router, (b_router, c_router) = router_deployment(config)._bound_deployment.init_args
    assert [(r.enable_lora, r.allow_runtime_lora_updating) for r in (tiny_router, b_router, c_router)] == [
        (False, False), (True, True), (False, False)]
    clash = tmp_path / "clash.yaml"
    for entry, name in [("{model: /models/b, served_model_name: b, enable_lora: true, lora_modules: [tiny=/x]}",
                         "tiny"),
                        ("{model: /models/b, served_model_name: b, enable_lora: true, lora_modules: [sql=/x]}", "sql")]:
        clash.write_text(f"- {entry}\n")
        with pytest.raises(ValueError, match=f"adapter name '{name}' is already"):
            _config("--served-model-name", "tiny", "--enable-lora", "--lora-modules", "sql=/y",
                    "--extra-models", str(clash))
    clash.write_text("- {model: /models/b, served_model_name: b, lora_modules: [sql=/x]}\n")
    with pytest.raises(ValueError, match="lora_modules need enable_lora"):
        _config("--extra-models", str(clash))
    # vLLM's base_model_name in a JSON entry: the model it is listed for, or refused.
    entry = '{"name": "sql", "path": "/y", "base_model_name": "%s"}'
    for base in ("tiny", "meta-llama/Llama-2-7b"):  # (its own, or a name that is no other served model's)
        listed = _config("--served-model-name", "tiny", "--enable-lora", "--lora-modules", entry % base,
                         "--extra-models", str(models)).engine_configs()[0].lora_config.lora_modules
        assert listed[0].base_model_name == base
    with pytest.raises(ValueError, match="names base_model_name 'b' but is listed for 'tiny'"):
        _config("--served-model-name", "tiny", "--enable-lora", "--lora-modules", entry % "b",
                "--extra-models", str(models))
    # A relative adapter path in the file is read from the file's folder (where it exists there).
    (tmp_path / "adapters" / "near").mkdir(parents=True)
    models.write_text("- {model: /models/b, served_model_name: b, enable_lora: true,\n"
                      "   lora_modules: [near=adapters/near, {name: far, path: adapters/far}]}\n")
    b_adapters = _config("--extra-models", str(models)).engine_configs()[1].lora_config.lora_modules
    assert [(m.name, m.path) for m in b_adapters] == [("near", str(tmp_path / "adapters" / "near")),
                                                       ("far", "adapters/far")]


def test_expert_parallelism_reaches_the_engines_workers(tmp_path):
    from gpu_worker.executor import _worker_kwargs

    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {enable_expert_parallel: false}\n")
    engines = _config("--num-engines", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel",
                      "--engine-config", str(overrides)).engine_configs()
    assert [e.enable_expert_parallel for e in engines] == [True, False]
    assert _config("-ep").engine_configs()[0].enable_expert_parallel is True
    assert _config().engine_configs()[0].enable_expert_parallel is False
    assert _worker_kwargs(engines[0], tmp_path, 128, 1)["enable_expert_parallel"] is True


def test_pipeline_parallel_size_reaches_every_engine_and_multiplies_its_workers(tmp_path):
    """--pipeline-parallel-size / -pp (vLLM's flags): each engine's layers in that many stages, each
    a tensor-parallel group, so TP x PP workers per engine; serve and run-batch take it alike."""
    for flags in (["--pipeline-parallel-size", "2"], ["-pp", "2"], ["--pipeline-parallel-size=2"]):
        engines = _config("--num-engines", "2", "-tp", "2", *flags).engine_configs()
        assert [(e.pipeline_parallel_size, e.tensor_parallel_size, e.world_size) for e in engines] == [(2, 2, 4)] * 2
    assert (_config().engine_configs()[0].pipeline_parallel_size, _config().engine_configs()[0].world_size) == (1, 1)
    batch = build_parser().parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "-pp", "3"])
    assert cluster_config_from_args(batch).engine_configs()[0].pipeline_parallel_size == 3
    # Per engine, over the flag.
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {pipeline_parallel_size: 1}\n")
    engines = _config("--num-engines", "2", "-pp", "2", "--engine-config", str(overrides)).engine_configs()
    assert [e.pipeline_parallel_size for e in engines] == [2, 1]
    # Speculative decoding is not built under pipeline parallelism.
    with pytest.raises(ValueError, match="engine 0: speculative_config must be unset with pipeline_parallel_size"):
        _config("-pp", "2", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'
                ).engine_configs()
    # Engines that hand KV to each other split their layers alike: rank i hands its layers to rank i.
    with pytest.raises(ValueError, match="pipeline_parallel_size, dtype, kv_cache_dtype and device must be the same"):
        _config("--num-engines", "2", "--num-prefill-engines", "1", "-pp", "2", "--engine-config", str(overrides)
                ).engine_configs()
    assert [e.pipeline_parallel_size for e in _config("--num-engines", "2", "--num-prefill-engines", "1", "-pp", "2"
                                                      ).engine_configs()] == [2, 2]


def test_runner_and_pooler_config_reach_the_engines(tmp_path):
    """--runner pooling and --pooler-config (vLLM's flags) reach every engine of the model."""
    from gpu_worker.executor import _worker_kwargs

    engines = _config("--num-engines", "2", "--runner", "pooling", "--pooler-config",
                      '{"pooling_type": "MEAN", "normalize": false}').engine_configs()
    assert [e.runner for e in engines] == ["pooling", "pooling"]
    assert dict(engines[1].pooler_config) == {"pooling_type": "MEAN", "normalize": False}
    assert _worker_kwargs(engines[0], tmp_path, 128, 1)["embedding_only"] is True
    assert _worker_kwargs(_config().engine_configs()[0], tmp_path, 128, 1)["embedding_only"] is False
    assert _config().engine_configs()[0].runner == "auto"
    # One model's engines must agree: its endpoints answer one way whichever engine a request reaches.
    overrides = tmp_path / "engines.yaml"
    for override in ("{runner: generate}", "{pooler_config: {pooling_type: CLS}}",
                     "{hf_overrides: {num_labels: 3}}"):
        overrides.write_text(f"- {{}}\n- {override}\n")
        with pytest.raises(ValueError, match="engine 1: runner, pooler_config and hf_overrides must be the same"):
            _config("--num-engines", "2", "--runner", "pooling", "--engine-config", str(overrides)).engine_configs()
    with pytest.raises(ValueError, match="pooler_config must be an object of pooling_type"):
        _config("--pooler-config", '{"pooling_type": "MAX"}').engine_configs()
    # STEP pooling's settings (a process reward model's) arrive hashable; bad ones are refused.
    [step] = _config("--pooler-config", '{"pooling_type": "STEP", "step_tag_id": 12902, '
                                        '"returned_token_ids": [648, 387]}').engine_configs()
    assert dict(step.pooler_config) == {"pooling_type": "STEP", "step_tag_id": 12902, "returned_token_ids": (648, 387)}
    assert hash(step)
    for bad in ('{"pooling_type": "STEP", "step_tag_id": "x"}', '{"pooling_type": "STEP", "returned_token_ids": []}',
                '{"pooling_type": "ALL", "softmax": true}'):
        with pytest.raises(ValueError, match="pooler_config must be an object of pooling_type"):
            _config("--pooler-config", bad).engine_configs()


def test_hf_overrides_reach_the_engines_as_json(tmp_path):
    import json

    from gpu_worker.executor import _worker_kwargs

    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
    [engine] = _config("--hf-overrides", json.dumps(overrides)).engine_configs()
    assert json.loads(engine.hf_overrides) == overrides
    assert _worker_kwargs(engine, tmp_path, 128, 1)["hf_overrides"] == overrides
    assert _config().engine_configs()[0].hf_overrides == ""


def test_mm_processor_kwargs_reach_the_engines_as_json_the_same_on_each(tmp_path):
    import json

    from gpu_worker.executor import _worker_kwargs

    engines = _config("--num-engines", "2", "--mm-processor-kwargs", '{"max_pixels": 200704}').engine_configs()
    assert [json.loads(e.mm_processor_kwargs) for e in engines] == [{"max_pixels": 200704}] * 2
    assert _worker_kwargs(engines[0], tmp_path, 128, 1)["mm_processor_kwargs"] == {"max_pixels": 200704}
    assert _worker_kwargs(_config().engine_configs()[0], tmp_path, 128, 1)["mm_processor_kwargs"] is None
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {mm_processor_kwargs: {max_pixels: 1000}}\n")
    with pytest.raises(ValueError, match="engine 1: mm_processor_kwargs must be the same on every engine"):
        _config("--num-engines", "2", "--engine-config", str(overrides)).engine_configs()


def test_kv_cache_metrics_reach_the_engines_only_when_asked(tmp_path):
    assert {e.kv_cache_metrics_sample for e in _config("--num-engines", "2").engine_configs()} == {None}
    assert {e.kv_cache_metrics_sample for e in _config("--kv-cache-metrics").engine_configs()} == {0.01}
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {kv_cache_metrics: false}\n")
    engines = _config("--num-engines", "2", "--kv-cache-metrics", "--kv-cache-metrics-sample", "0.25",
                      "--engine-config", str(overrides)).engine_configs()
    assert [e.kv_cache_metrics_sample for e in engines] == [0.25, None]


def test_the_generation_config_flags_reach_every_engine_of_the_model(tmp_path):
    """--generation-config and --override-generation-config (vLLM's), the same on every engine of a model."""
    import json

    engines = _config("--num-engines", "2", "--generation-config", "vllm", "--override-generation-config",
                      '{"temperature": 0.5, "max_new_tokens": 64}').engine_configs()
    assert [e.generation_config for e in engines] == ["vllm", "vllm"]
    override = {"temperature": 0.5, "max_new_tokens": 64}
    assert [json.loads(e.override_generation_config) for e in engines] == [override, override]
    [default] = _config().engine_configs()
    assert (default.generation_config, default.override_generation_config) == ("auto", "")
    overrides = tmp_path / "engines.yaml"
    for override in ("{generation_config: vllm}", "{override_generation_config: {top_p: 0.5}}"):
        overrides.write_text(f"- {{}}\n- {override}\n")
        with pytest.raises(ValueError, match="engine 1: generation_config, override_generation_config and "
                                             "max_logprobs must be the same on every engine"):
            _config("--num-engines", "2", "--engine-config", str(overrides)).engine_configs()
    with pytest.raises(SystemExit):
        _config("--override-generation-config", "[0.5]")
    # A further model reads its own generation config: not the first model's folder or override
    # (the limit on logprobs is the cluster's); a folder of its own sits beside its file.
    (tmp_path / "gc-a").mkdir()
    (tmp_path / "gc-b").mkdir()
    models = tmp_path / "models.yaml"
    models.write_text("- {model: /models/b}\n- {model: /models/c, defaults: {generation_config: gc-b}}\n")
    a, b, c = _config("--generation-config", str(tmp_path / "gc-a"), "--override-generation-config",
                      '{"temperature": 0.3}', "--max-logprobs", "50", "--extra-models", str(models)).engine_configs()
    assert (a.generation_config, a.override_generation_config) == (str(tmp_path / "gc-a"), '{"temperature": 0.3}')
    assert (b.generation_config, b.override_generation_config, b.max_logprobs) == ("auto", "", 50)
    assert c.generation_config == str(tmp_path / "gc-b")


def test_several_served_model_names_reach_the_engines_and_the_router(tmp_path):
    """vLLM's --served-model-name a b: the engines (and their metrics) carry the first; the router
    takes the others as aliases. Names stay unique across models, aliases and adapters."""
    models = tmp_path / "models.yaml"
    models.write_text("- {model: /models/b, served_model_name: [b, b-latest]}\n")
    config = _config("--served-model-name", "tiny", "tiny-v1", "--extra-models", str(models))
    assert config.served_model_name == ["tiny", "tiny-v1"] and config.names_per_model() == [["tiny", "tiny-v1"],
                                                                                          ["b", "b-latest"]]
    assert [e.served_model_name for e in config.engine_configs()] == ["tiny", "b"]
    first, [b] = router_deployment(config)._bound_deployment.init_args
    assert (first.served_model_name, first.served_model_aliases) == ("tiny", ("tiny-v1",))
    assert (b.served_model_name, b.served_model_aliases) == ("b", ("b-latest",))
    one = router_deployment(_config("--served-model-name", "tiny"))._bound_deployment.init_args[0]
    assert (one.served_model_name, one.served_model_aliases) == ("tiny", ())
    default = router_deployment(_config())._bound_deployment.init_args[0]
    assert (default.served_model_name, default.served_model_aliases) == (None, ())
    for names, message in ((["tiny", "b-latest"], "two served models are named 'b-latest'"),
                           (["tiny", "tiny"], "served_model_name lists a name twice")):
        with pytest.raises(ValueError, match=message):
            _config("--served-model-name", *names, "--extra-models", str(models))
    with pytest.raises(ValueError, match="the LoRA adapter name 'tiny-v1' is already a served model's"):
        _config("--served-model-name", "tiny", "tiny-v1", "--enable-lora", "--lora-modules", "tiny-v1=/a")
    # An adapter may name its model by an alias, not another model's.
    _config("--served-model-name", "tiny", "tiny-v1", "--enable-lora", "--lora-modules",
            '{"name": "sql", "path": "/a", "base_model_name": "tiny-v1"}')
    with pytest.raises(ValueError, match="names base_model_name 'b-latest' but is listed for 'tiny'"):
        _config("--served-model-name", "tiny", "tiny-v1", "--extra-models", str(models), "--enable-lora",
                "--lora-modules", '{"name": "sql", "path": "/a", "base_model_name": "b-latest"}')
    assert served_models_line(config, {0: "tiny", 1: "b"}) == "tiny (also tiny-v1), b (also b-latest)"
    assert served_models_line(_config("--num-engines", "2"), dict.fromkeys([0, 1], "SmolLM2-135M-Instruct")
                              ) == "SmolLM2-135M-Instruct"
    # An autoscaled first model's further slots hold no engine yet: the next model's engine is engine 3.
    scaled = _config("--served-model-name", "tiny", "tiny-v1", "--extra-models", str(models),
                     "--engine-autoscaling", '{"max_engines": 3}')
    assert served_models_line(scaled, {0: "tiny", 3: "b"}) == "tiny (also tiny-v1), b (also b-latest)"
    # A model left unnamed is served under its directory's name: an alias may not take it.
    models.write_text("- {model: /models/c, served_model_name: [c, b]}\n")
    with pytest.raises(ValueError, match="two served models are named 'b'"):
        _config("--model", "/models/b", "--extra-models", str(models))


def test_seed_reaches_every_engine():
    assert [e.seed for e in _config("--num-engines", "2", "--seed", "7").engine_configs()] == [7, 7]
    assert _config().engine_configs()[0].seed == 0


def test_logprobs_mode_is_vllms_flag_and_the_same_on_every_engine_of_a_model(tmp_path):
    """--logprobs-mode (vLLM's four modes) reaches every engine, a further model's too; a vLLM
    command line keeps it; a per-engine value that differs is refused."""
    from cluster.cli import vllm_command_line

    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        argv, _ = vllm_command_line(["serve", "m", "--logprobs-mode", mode])
        assert argv == ["serve", "m", "--logprobs-mode", mode]
        models = tmp_path / "models.yaml"
        models.write_text("- {model: /models/b}\n")
        engines = _config("--num-engines", "2", "--logprobs-mode", mode, "--extra-models", str(models)).engine_configs()
        assert [e.logprobs_mode for e in engines] == [mode] * 3
    assert _config().engine_configs()[0].logprobs_mode == "raw_logprobs"
    from gpu_worker.executor import _worker_kwargs  # (what each worker is started with)

    assert _worker_kwargs(engines[0], tmp_path, 128, 1)["logprobs_mode"] == "processed_logits"
    with pytest.raises(SystemExit):
        _config("--logprobs-mode", "processed")
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {logprobs_mode: processed_logits}\n")
    with pytest.raises(ValueError, match="engine 1: logprobs_mode must be the same on every engine of a model "
                                         "\\(engine 0 has 'raw_logprobs', this one 'processed_logits'\\)"):
        _config("--num-engines", "2", "--engine-config", str(overrides)).engine_configs()
    # The same mode set per engine is taken.
    overrides.write_text("- {logprobs_mode: raw_logits}\n- {logprobs_mode: raw_logits}\n")
    assert {e.logprobs_mode for e in _config("--num-engines", "2", "--engine-config",
                                             str(overrides)).engine_configs()} == {"raw_logits"}


def test_max_logprobs_reaches_every_engine():
    assert [e.max_logprobs for e in _config("--num-engines", "2", "--max-logprobs", "-1").engine_configs()] == [-1, -1]
    assert _config().engine_configs()[0].max_logprobs == 20
    with pytest.raises(ValueError, match="max_logprobs"):
        _config("--max-logprobs", "-2").engine_configs()


def test_prefill_decode_flags_give_each_engine_its_role_and_the_router_the_roles(tmp_path):
    config = _config("--num-engines", "3", "--num-prefill-engines", "1", "--kv-transfer-config",
                     '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"}')
    engines = config.engine_configs()
    assert [e.kv_transfer_config.kv_role for e in engines] == ["kv_producer", "kv_consumer", "kv_consumer"]
    assert {e.kv_transfer_config.kv_load_failure_policy for e in engines} == {"fail"}
    [router] = router_deployment(config)._bound_deployment.init_args
    assert router.engine_kv_roles == ("kv_producer", "kv_consumer", "kv_consumer")
    assert router.pd_prefill_threshold == 0
    [router] = router_deployment(_config("--pd-prefill-threshold", "512"))._bound_deployment.init_args
    assert router.pd_prefill_threshold == 512
    # One flag for all, roles per engine from --engine-config (an engine without one takes the flag's).
    overrides = tmp_path / "pd.yaml"
    overrides.write_text("- {kv_transfer_config: {kv_role: kv_producer}}\n- {}\n")
    engines = _config("--num-engines", "2", "--engine-config", str(overrides), "--kv-transfer-config",
                      '{"kv_role": "kv_consumer"}').engine_configs()
    assert [e.kv_transfer_config.kv_role for e in engines] == ["kv_producer", "kv_consumer"]
    assert _config().engine_configs()[0].kv_transfer_config is None
    for flags, message in ((["--num-engines", "2", "--num-prefill-engines", "2"], "needs at least one engine of each"),
                           (["--kv-transfer-config", '{"kv_role": "kv_sender"}'], "kv_role must be one of"),
                           (["--num-engines", "2", "--num-prefill-engines", "1", "--engine-config", str(overrides)],
                            None)):
        if message is None:  # (the override's producer kept, the other engine a consumer)
            assert [e.kv_transfer_config.kv_role for e in _config(*flags).engine_configs()] == \
                ["kv_producer", "kv_consumer"]
            continue
        with pytest.raises(ValueError, match=message):
            _config(*flags).engine_configs()
    # Engines that hand KV on must lay it out alike.
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("- {block_size: 32}\n- {}\n")
    with pytest.raises(ValueError, match="must be the same on every engine of a model with kv_transfer_config"):
        _config("--num-engines", "2", "--num-prefill-engines", "1", "--engine-config", str(mixed)).engine_configs()


def test_kv_offloading_flags_reach_every_engine():
    configs = _config("--num-engines", "2", "--kv-offloading-size", "4", "--kv-offloading-backend", "native"
                      ).engine_configs()
    assert [e.kv_offloading_size for e in configs] == [4.0, 4.0]
    assert _config().engine_configs()[0].kv_offloading_size is None
    with pytest.raises(SystemExit):
        _config("--kv-offloading-backend", "lmcache")


def test_enable_prompt_embeds_reaches_every_engine_of_the_model(tmp_path):
    assert [e.enable_prompt_embeds for e in _config("--num-engines", "2", "--enable-prompt-embeds").engine_configs()
            ] == [True, True]
    assert _config().engine_configs()[0].enable_prompt_embeds is False
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {enable_prompt_embeds: false}\n")
    with pytest.raises(ValueError, match="engine 1: enable_prompt_embeds must be the same on every engine"):
        _config("--num-engines", "2", "--enable-prompt-embeds", "--engine-config", str(overrides)).engine_configs()


def test_logits_processors_reach_every_engine_of_the_model(tmp_path):
    names = ["tests.logits_processors:TargetTokenProcessor", "tests.logits_processors.NoEchoAdapter"]
    configs = _config("--num-engines", "2", "--logits-processors", *names).engine_configs()
    assert [e.logits_processors for e in configs] == [tuple(names)] * 2
    assert _config().engine_configs()[0].logits_processors == ()
    overrides = tmp_path / "engines.yaml"
    overrides.write_text("- {}\n- {logits_processors: [a.b:C]}\n")
    with pytest.raises(ValueError, match="engine 1: logits_processors must be the same on every engine"):
        _config("--num-engines", "2", "--engine-config", str(overrides)).engine_configs()


def test_cors_and_request_id_flags_reach_the_router():
    from router.serving import CORSSettings

    def router(*flags):
        return router_deployment(_config(*flags))._bound_deployment.init_args[0]

    default = router()
    assert default.cors == CORSSettings()
    chosen = router("--allowed-origins", '["https://ui.example.com"]', "--allowed-methods", '["GET", "POST"]',
                    "--allowed-headers", '["content-type"]', "--allow-credentials",
                    "--enable-request-id-headers")  # (accepted for vLLM's command lines; Serve always sets it)
    assert chosen.cors == CORSSettings(("https://ui.example.com",), ("GET", "POST"), ("content-type",), True)
    with pytest.raises(SystemExit):
        _config("--allowed-origins", "https://ui.example.com")  # (a JSON list, as vLLM takes it)


def test_disable_log_stats_reaches_every_engine():
    assert [e.log_stats for e in _config("--num-engines", "2", "--disable-log-stats").engine_configs()] == [False] * 2
    assert _config().engine_configs()[0].log_stats is True


def test_chat_template_defaults_and_request_logging_reach_each_models_router(tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text("- {model: /models/b, served_model_name: b,\n"
                      "   default_chat_template_kwargs: {reasoning_effort: low}}\n")
    first, [b] = router_deployment(_config(
        "--default-chat-template-kwargs", '{"enable_thinking": false}', "--enable-log-requests", "--max-log-len", "64",
        "--enable-log-outputs", "--extra-models", str(models)))._bound_deployment.init_args
    assert (first.default_chat_template_kwargs, first.enable_log_requests, first.max_log_len) == (
        {"enable_thinking": False}, True, 64)
    assert first.enable_log_outputs and b.enable_log_outputs
    assert (b.default_chat_template_kwargs, b.enable_log_requests) == ({"reasoning_effort": "low"}, True)
    plain = router_deployment(_config())._bound_deployment.init_args[0]
    assert (plain.default_chat_template_kwargs, plain.enable_log_requests, plain.max_log_len) == ({}, False, None)
    assert not plain.enable_log_outputs
    with pytest.raises(ValueError, match="default_chat_template_kwargs may not set add_generation_prompt"):
        _config("--default-chat-template-kwargs", '{"add_generation_prompt": false}')


def test_vllms_server_wide_request_flags_reach_the_router():
    names = ("enable_force_include_usage", "return_tokens_as_token_ids", "exclude_tools_when_tool_choice_none",
             "disable_fastapi_docs")

    def flags(*args):
        config = router_deployment(_config(*args))._bound_deployment.init_args[0]
        return [getattr(config, name) for name in names]

    assert flags() == [False] * 4
    assert flags(*(f"--{name.replace('_', '-')}" for name in names)) == [True] * 4
    config = router_deployment(_config())._bound_deployment.init_args[0]
    assert (config.response_role, config.chat_template_content_format) == ("assistant", "auto")
    config = router_deployment(_config("--response-role", "bot", "--chat-template-content-format", "openai")
                               )._bound_deployment.init_args[0]
    assert (config.response_role, config.chat_template_content_format) == ("bot", "openai")


def test_the_tokenizer_flag_reaches_the_first_models_engines_only(tmp_path, monkeypatch):
    """--tokenizer is the first model's; a further model names its own (a path beside its file)."""
    (tmp_path / "tok-b").mkdir()
    models = tmp_path / "models.yaml"
    models.write_text("- {model: /models/b, served_model_name: b, tokenizer: tok-b}\n- {model: /models/c}\n")
    engines = _config("--num-engines", "2", "--tokenizer", "/tokenizers/llama-3", "--extra-models",
                      str(models)).engine_configs()
    assert [e.tokenizer for e in engines] == ["/tokenizers/llama-3"] * 2 + [str(tmp_path / "tok-b"), None]
    assert _config().engine_configs()[0].tokenizer is None
    monkeypatch.chdir(tmp_path)  # (a local directory goes to the engines by its full path)
    assert _config("--tokenizer", "tok-b").engine_configs()[0].tokenizer == str(tmp_path / "tok-b")


def test_image_flags_reach_the_router_per_model(tmp_path, monkeypatch):
    """vLLM's --limit-mm-per-prompt (JSON, or its dotted form; each model its own) and
    --allowed-local-media-path (the server's) reach the router config; an unknown modality stops."""
    from cluster.cli import vllm_command_line

    models = tmp_path / "models.yaml"
    models.write_text("- {model: /models/b, limit_mm_per_prompt: {image: 1}}\n- {model: /models/c}\n")
    (tmp_path / "media").mkdir()
    monkeypatch.chdir(tmp_path)
    argv, _ = vllm_command_line(["serve", "/models/a", "--limit-mm-per-prompt.image", "2",
                                 "--allowed-local-media-path", "media", "--extra-models", str(models),
                                 "--mm-processor-cache-gb", "0.5", "--allowed-media-domains", "Img.example.com",
                                 "cdn.example.com"])
    first, more = router_deployment(_config(*argv[1:]))._bound_deployment.init_args
    assert (first.limit_mm_per_prompt, first.allowed_local_media_path) == ({"image": 2}, str(tmp_path / "media"))
    assert first.mm_processor_cache_gb == 0.5 and _config().mm_processor_cache_gb == 4.0  # (vLLM's default)
    assert first.allowed_media_domains == ("img.example.com", "cdn.example.com")
    assert router_deployment(_config())._bound_deployment.init_args[0].allowed_media_domains == ()
    assert [(m.limit_mm_per_prompt, m.allowed_local_media_path) for m in more] == [
        ({"image": 1}, str(tmp_path / "media")), ({}, str(tmp_path / "media"))]
    assert _config("--limit-mm-per-prompt", '{"image": 0}').limit_mm_per_prompt == {"image": 0}
    assert (_config().limit_mm_per_prompt, _config().allowed_local_media_path) == ({}, "")
    with pytest.raises(ValueError, match="'images' is not a modality"):
        _config("--limit-mm-per-prompt", '{"images": 2}')
    # vLLM's --media-io-kwargs: how videos' frames are sampled, the server's, for every model.
    sampled = router_deployment(_config("--media-io-kwargs", '{"video": {"num_frames": 16}}', "--extra-models",
                                        str(models)))._bound_deployment.init_args
    assert [c.media_io_kwargs for c in (sampled[0], *sampled[1])] == [{"video": {"num_frames": 16}}] * 3
    for bad, why in (('{"image": {"size": 2}}', "only video's are served"), ('{"video": {"fps": 0}}', "fps"),
                     ('{"video": {"num_frames": 4, "fps": 1}}', "exclusive")):
        with pytest.raises(ValueError, match=why):
            _config("--media-io-kwargs", bad)


def test_a_serve_configs_args_may_not_set_the_clis_host_and_port():
    """Serve's proxy listens where http_options say: host and port among the args were ignored."""
    from cluster.app import build_app

    with pytest.raises(ValueError, match=r"host, port: set the address Serve listens on in the Serve config's "
                                         r"http_options"):
        build_app({"model": "/models/a", "host": "0.0.0.0", "port": 9000})


def test_dtype_is_checked_with_the_other_engine_flags():
    with pytest.raises(ValueError, match=r"engine 0: dtype must be one of auto, bfloat16, .*got 'bogus'"):
        ClusterConfig(model="/models/a", defaults=EngineSpec(dtype="bogus")).engine_configs()
    assert ClusterConfig(model="/models/a", defaults=EngineSpec(dtype="half")).engine_configs()[0].dtype == "half"


def test_vllm_serve_command_lines_are_read_as_vllm_reads_them(capsys):
    """The model as a positional argument, -tp/-dp, --no- forms, snake_case flags, sizes like 32K,
    several API keys after one flag; flags with nothing to do here are taken out with a warning."""
    from cluster.cli import human_readable_int, vllm_command_line

    argv, warnings = vllm_command_line(["serve", "/models/a", "--max_model_len=32K", "--enforce-eager", "--swap-space",
                                        "4", "-pp", "1", "--tokenizer-mode", "auto", "-O3", "--no-enforce-eager",
                                        "--seed", "-1"])
    assert argv == ["serve", "/models/a", "--max-model-len=32K", "-pp", "1", "--seed", "-1"]  # (-pp: a flag here)
    assert [w.split(" has no effect here:")[0] for w in warnings] == ["--enforce-eager", "--swap-space", "-O",
                                                                      "--enforce-eager"]
    config = _config("/models/a", "-tp", "2", "-dp", "3", "--no-enable-prefix-caching", "--api-key", "k1", "k2",
                     "--max-model-len", "32K", "--kv-cache-memory-bytes", "8G", "--max-num-batched-tokens", "8k",
                     "--no-enable-log-requests", "--enable-lora", "--no-enable-lora")
    engines = config.engine_configs()
    assert (config.model, len(engines), config.api_keys, config.enable_log_requests, config.enable_lora) == (
        "/models/a", 3, ["k1", "k2"], False, False)
    engine = engines[0]
    assert (engine.tensor_parallel_size, engine.enable_prefix_caching, engine.scheduler.max_model_len,
            engine.kv_cache_memory_bytes, engine.scheduler.max_num_batched_tokens) == (2, False, 32768, 8 << 30, 8000)
    assert _config().model == "SmolLM2-135M-Instruct" and _config("--model", "/models/b").model == "/models/b"
    assert _config("--api-key", "a", "--api-key", "b").api_keys == ["a", "b"]
    assert [human_readable_int(t) for t in ("4096", "1.5k", "2m", "1K", "2G")] == [4096, 1500, 2_000_000, 1024,
                                                                                    2 << 30]
    for bad in ("1.5K", "big", "4 k"):
        with pytest.raises(Exception, match=r"whole number|no decimals"):
            human_readable_int(bad)


def test_more_of_vllms_flags_are_taken_renamed_or_refused_with_why():
    """Flags vLLM users pass that change nothing here are taken with a warning; --api-server-count
    is our router replicas; what is not built is refused unless given its neutral value."""
    from cluster.cli import vllm_command_line

    argv, warnings = vllm_command_line([
        "serve", "m", "--async-scheduling", "--hf-token", "t", "--distributed-executor-backend", "ray",
        "--api-server-count=2", "--guided-decoding-backend", "auto", "--model-impl", "vllm"])
    assert argv == ["serve", "m", "--num-router-replicas=2"]
    assert [w.split(" has no effect here:")[0] for w in warnings] == [
        "--async-scheduling", "--hf-token", "--distributed-executor-backend"]
    assert build_parser().parse_args(argv).num_router_replicas == 2
    # --hf-token may come without its value (vLLM's: the token saved by huggingface-cli login).
    assert vllm_command_line(["serve", "m", "--hf-token", "--max-model-len", "4096"])[0] == [
        "serve", "m", "--max-model-len", "4096"]
    assert vllm_command_line(["serve", "m", "--hf-token", "-tp", "2"])[0] == ["serve", "m", "-tp", "2"]
    assert vllm_command_line(["serve", "m", "--cuda-graph-sizes", "1", "2", "4", "-tp", "2"])[0] == [
        "serve", "m", "-tp", "2"]
    assert vllm_command_line(["serve", "--cuda-graph-sizes", "8", "16", "Qwen/Qwen3-0.6B"])[0] == [
        "serve", "Qwen/Qwen3-0.6B"]  # (the model after the sizes is not one of them)
    with pytest.raises(ValueError, match="--model-impl"):
        vllm_command_line(["serve", "m", "--model-impl", "transformers"])
    # A neutral number however written.
    assert vllm_command_line(["serve", "m", "--cpu-offload-gb", "0.0"])[0] == ["serve", "m"]
    with pytest.raises(ValueError, match="--cpu-offload-gb"):
        vllm_command_line(["serve", "m", "--cpu-offload-gb", "4"])


def test_vllms_dotted_json_flags_become_one_json_value():
    from cluster.cli import vllm_command_line

    argv, warnings = vllm_command_line([
        "serve", "m", "--structured-outputs-config.backend", "xgrammar",
        "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
        "--kv_transfer_config.kv_role=kv_consumer", "--structured-outputs-config.disable_any_whitespace", "true",
        "--kv-transfer-config.kv_connector_extra_config.abort_request_timeout", "30",
        "--compilation-config.level", "3"])
    assert argv[:2] == ["serve", "m"] and [w.split(" has no effect")[0] for w in warnings] == [
        "--compilation-config.level"]
    values = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert json.loads(values["--kv-transfer-config"]) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"abort_request_timeout": 30}}
    assert json.loads(values["--structured-outputs-config"]) == {"backend": "xgrammar",
                                                                 "disable_any_whitespace": True}
    config = cluster_config_from_args(build_parser().parse_args(argv))
    assert config.structured_outputs_disable_any_whitespace
    assert config.engine_configs()[0].kv_transfer_config.abort_request_timeout_s == 30
    # -O's dotted form (vLLM's compilation config) takes its value along: the model stays the model.
    argv, warnings = vllm_command_line(["serve", "-O.level", "3", "m", "-O.cudagraph_mode", "FULL"])
    assert argv == ["serve", "m"] and len(warnings) == 2
    # A later nested key wins over an earlier value at its place.
    argv, _ = vllm_command_line(["serve", "m", "--hf-overrides.a", "1", "--hf-overrides.a.b", "2"])
    assert json.loads(argv[3]) == {"a": {"b": 2}}
    # A flag's own value that is not a JSON object is left for its check to refuse (not replaced).
    argv, _ = vllm_command_line(["serve", "m", "--kv-transfer-config", "{'kv_role': 'kv_producer'}",
                                 "--kv-transfer-config.kv_connector", "NixlConnector"])
    assert argv == ["serve", "m", "--kv-transfer-config", "{'kv_role': 'kv_producer'}"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_vllms_structured_outputs_config(capsys):
    """xgrammar as the backend, disable_any_whitespace as the server's default for JSON constraints,
    reasoning_parser as --reasoning-parser; what only other backends do is refused with why."""
    config = _config("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true, '
                                                    '"reasoning_parser": "qwen3", "disable_fallback": true}')
    # (A vLLM config dumped as it is: its unset reasoning_parser is "", others null.)
    assert _config("--structured-outputs-config", '{"backend": null, "reasoning_parser": ""}').reasoning_parser is None
    assert (config.structured_outputs_disable_any_whitespace, config.reasoning_parser) == (True, "qwen3")
    first = router_deployment(config)._bound_deployment.init_args[0]
    assert first.structured_outputs_disable_any_whitespace and first.reasoning_parser == "qwen3"
    assert not _config().structured_outputs_disable_any_whitespace
    for bad, why in (('{"backend": "guidance"}', "built with xgrammar"), ('{"enable_in_reasoning": true}', "not built"),
                     ('{"whitespace": 1}', "unknown key"), ('{"reasoning_parser": "nope"}', "one of")):
        with pytest.raises(SystemExit):
            _config("--structured-outputs-config", bad)
        assert why in capsys.readouterr().err
    with pytest.raises(ValueError, match="differ"):
        _config("--reasoning-parser", "deepseek_r1", "--structured-outputs-config", '{"reasoning_parser": "qwen3"}')


def test_a_lora_module_path_relative_to_here_reaches_the_engines_whole(tmp_path, monkeypatch):
    from engine_core.lora import parse_lora_module

    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    config = _config("--enable-lora", "--lora-modules", "sql=adapters/sql",
                     '{"name": "b", "path": "adapters/sql", "base_model_name": "m"}', "c=/elsewhere/c")
    assert [(m.name, m.path, m.base_model_name) for m in config.lora_module_list()] == [
        ("sql", str(tmp_path / "adapters" / "sql"), None), ("b", str(tmp_path / "adapters" / "sql"), "m"),
        ("c", "/elsewhere/c", None)]
    assert parse_lora_module("x=y").path == "y"  # (the engines' own parsing leaves paths as given)


def test_override_generation_config_values_are_checked_wherever_the_config_is_made():
    """With --address or from a Serve config (no files checked here) a bad value was found by each
    engine as it loaded."""
    for bad, message in (({"temperature": "hot"}, "temperature"), ({"top_p": 2}, "top_p")):
        with pytest.raises(ValueError, match=f"engine 0: .*{message}"):
            ClusterConfig(model="/models/a", address="ray://head:10001",
                          defaults=EngineSpec(override_generation_config=bad)).engine_configs()
    [engine] = ClusterConfig(model="/models/a", defaults=EngineSpec(
        override_generation_config={"temperature": 0.5})).engine_configs()
    assert engine.override_generation_config == '{"temperature": 0.5}'


def test_collect_env_reports_versions_and_leaves_secrets_out(capsys, monkeypatch):
    import importlib.metadata

    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret-value")
    monkeypatch.setenv("RAY_JOB_HEADERS", '{"Authorization": "Bearer secret-value"}')
    monkeypatch.setenv("RAY_ADDRESS", "ray://user:secret-value@head:10001")
    monkeypatch.setenv("LLM_CLUSTER_ENGINE_HOST", "127.0.0.1")
    assert main(["collect-env"]) == 0
    out = capsys.readouterr().out
    assert f"torch: {importlib.metadata.version('torch')}" in out and "LLM_CLUSTER_ENGINE_HOST=127.0.0.1" in out
    assert "secret-value" not in out and "CPUs:" in out and "RAY_ADDRESS=ray://***@head:10001" in out


def test_disable_chunked_mm_input_reaches_the_scheduler():
    assert _config("--disable-chunked-mm-input").engine_configs()[0].scheduler.disable_chunked_mm_input
    assert not _config().engine_configs()[0].scheduler.disable_chunked_mm_input
