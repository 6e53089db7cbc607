"""The metrics exposition: TGI's exact names (counters without `_total`, no `_created`), types,
and values, as prometheus_client writes them (`le="1.0"`, `3.0`)."""

from __future__ import annotations

import threading

from prometheus_client.parser import text_string_to_metric_families

from tgq.api.metrics import JOB_STATUSES, LATENCY_BUCKETS_S, Metrics
from tgq.batcher.messages import Heartbeat

TGI_TYPES = {
    "tgi_request_count": "counter",
    "tgi_request_success": "counter",
    "tgi_request_failure": "counter",
    "tgi_request_duration": "histogram",
    "tgi_request_validation_duration": "histogram",
    "tgi_request_queue_duration": "histogram",
    "tgi_request_inference_duration": "histogram",
    "tgi_request_mean_time_per_token_duration": "histogram",
    "tgi_request_generated_tokens": "histogram",
    "tgi_request_input_length": "histogram",
    "tgi_request_max_new_tokens": "histogram",
    "tgi_queue_size": "gauge",
    "tgi_batch_current_size": "gauge",
}
TGQ_TYPES = {
    "tgq_time_to_first_token_seconds": "histogram",
    "tgq_inter_token_latency_seconds": "histogram",
    "tgq_requests_rejected": "counter",
    "tgq_key_requests": "counter",
    "tgq_key_prompt_tokens": "counter",
    "tgq_key_completion_tokens": "counter",
    "tgq_key_rate_limited": "counter",
    "tgq_requests_in_flight": "gauge",
    "tgq_tokenizer_calls": "counter",
    "tgq_batchers_alive": "gauge",
    "tgq_jobs": "gauge",
    "tgq_kv_cache_usage_ratio": "gauge",
    "tgq_prefix_cache_queries": "counter",
    "tgq_prefix_cache_hits": "counter",
    "tgq_batch_steps": "counter",
    "tgq_batch_step_tokens": "counter",
    "tgq_batch_step_tokens_max": "gauge",
    "tgq_batch_request_counts": "gauge",
    "tgq_grammar_cache_hits": "counter",
    "tgq_grammar_compile_failures": "counter",
    "tgq_grammar_masks": "counter",
    "tgq_grammar_mask_seconds": "counter",
    "tgq_grammar_argmax_checks": "counter",
    "tgq_grammar_argmax_misses": "counter",
    "tgq_grammar_compile_duration": "histogram",
    "tgq_spec_proposed_tokens": "counter",
    "tgq_spec_accepted_tokens": "counter",
    "tgq_spec_verify_forwards": "counter",
    "tgq_spec_acceptance_ratio": "histogram",
}


def parse(metrics: Metrics) -> tuple[dict[str, str], dict[str, float]]:
    """`# TYPE` lines as {name: type}; samples as {'name{labels}' exactly as written: value}."""
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            assert series not in samples, f"duplicate series {series}"
            samples[series] = float(value)
    return types, samples


def success(
    metrics: Metrics,
    *,
    total_s: float = 1.6,
    time_per_token_s: float | None = 0.015,
    num_input_tokens: int = 120,
) -> None:
    metrics.on_success(
        validation_s=0.002,
        queue_s=0.03,
        inference_s=1.5,
        total_s=total_s,
        time_per_token_s=time_per_token_s,
        num_input_tokens=num_input_tokens,
        num_generated_tokens=100,
        max_new_tokens=200,
    )


def new_metrics() -> Metrics:
    return Metrics(max_input_tokens=1000, max_total_tokens=2000)


def test_names_and_types_are_tgis_with_no_total_suffix() -> None:
    types, samples = parse(new_metrics())
    assert types == TGI_TYPES | TGQ_TYPES
    assert not any("_total" in series or "_created" in series for series in samples)
    assert samples["tgi_request_count"] == 0
    assert samples["tgi_queue_size"] == 0


def test_each_instance_counts_apart() -> None:
    """Two apps in one process (the tests start several) keep their own registries."""
    first, second = new_metrics(), new_metrics()
    first.on_request()
    first.set_batchers([beat("b0", 5, 75, 1000, 640)])
    _, samples = parse(second)
    assert samples["tgi_request_count"] == 0
    assert samples["tgq_batchers_alive"] == 0
    assert parse(first)[1]["tgi_request_count"] == 1


def test_counters_count_and_labels_separate_series() -> None:
    metrics = new_metrics()
    for _ in range(3):
        metrics.on_request()
    metrics.on_failure("validation")
    metrics.on_failure("validation")
    metrics.on_failure("template")
    metrics.on_rejected("queue_tokens")
    metrics.on_rejected("custom")
    _, samples = parse(metrics)
    assert samples["tgi_request_count"] == 3
    assert samples['tgi_request_failure{err="validation"}'] == 2
    assert samples['tgi_request_failure{err="template"}'] == 1
    assert samples['tgi_request_failure{err="dropped"}'] == 0
    assert samples['tgq_requests_rejected{reason="queue_tokens"}'] == 1
    assert samples['tgq_requests_rejected{reason="concurrency"}'] == 0
    assert samples['tgq_requests_rejected{reason="custom"}'] == 1


def test_gauges_hold_the_last_value() -> None:
    metrics = new_metrics()
    metrics.set_queue_size(7)
    metrics.set_queue_size(4)
    metrics.set_in_flight(3)
    _, samples = parse(metrics)
    assert samples["tgi_queue_size"] == 4
    assert samples["tgq_requests_in_flight"] == 3


def beat(batcher_id: str, num_running: int, num_free: int, queries: int, hits: int) -> Heartbeat:
    return Heartbeat(
        batcher_id=batcher_id,
        num_running=num_running,
        num_waiting=0,
        num_free_blocks=num_free,
        max_batch_size=64,
        time=0.0,
        num_usable_blocks=100,
        num_prefix_query_tokens=queries,
        num_prefix_hit_tokens=hits,
        num_steps=hits + 1,
        num_step_tokens=queries,
        max_step_tokens=num_running,
        grammar_compiles=[0, 2, 1] + [0] * 9 + [1],
        grammar_compile_seconds=7.5,
        num_grammar_cache_hits=hits // 2,
        num_grammar_masks=hits * 3,
        grammar_mask_seconds=0.25,
        num_grammar_argmax_checks=700,
        num_grammar_argmax_misses=7,
        num_spec_proposed=90,
        num_spec_accepted=50,
        num_spec_verified=30,
        spec_acceptance=[10, 0, 0, 0, 0, 5, 0, 0, 0, 0, 15],
        spec_acceptance_sum=17.5,
    )


def test_batcher_gauges_follow_the_live_heartbeats() -> None:
    metrics = new_metrics()
    metrics.set_batchers([beat("b0", 5, 75, 1000, 640), beat("b1", 7, 100, 32, 0)])
    _, samples = parse(metrics)
    assert samples["tgq_batchers_alive"] == 2
    assert samples["tgi_batch_current_size"] == 12
    assert samples['tgq_kv_cache_usage_ratio{batcher="b0"}'] == 0.25
    assert samples['tgq_kv_cache_usage_ratio{batcher="b1"}'] == 0.0
    assert samples['tgq_prefix_cache_queries{batcher="b0"}'] == 1000
    assert samples['tgq_prefix_cache_hits{batcher="b0"}'] == 640
    assert samples['tgq_batch_steps{batcher="b0"}'] == 641
    assert samples['tgq_batch_step_tokens{batcher="b0"}'] == 1000
    assert samples['tgq_batch_step_tokens_max{batcher="b1"}'] == 7
    assert samples['tgq_grammar_cache_hits{batcher="b0"}'] == 320
    assert samples['tgq_grammar_masks{batcher="b0"}'] == 1920
    assert samples['tgq_grammar_mask_seconds{batcher="b0"}'] == 0.25
    assert samples['tgq_grammar_argmax_checks{batcher="b0"}'] == 700
    assert samples['tgq_grammar_argmax_misses{batcher="b0"}'] == 7
    assert samples['tgq_grammar_compile_duration_bucket{batcher="b0",le="0.001"}'] == 0
    assert samples['tgq_grammar_compile_duration_bucket{batcher="b0",le="0.005"}'] == 3
    assert samples['tgq_grammar_compile_duration_bucket{batcher="b0",le="+Inf"}'] == 4
    assert samples['tgq_grammar_compile_duration_count{batcher="b0"}'] == 4
    assert samples['tgq_grammar_compile_duration_sum{batcher="b0"}'] == 7.5
    assert samples['tgq_spec_proposed_tokens{batcher="b0"}'] == 90
    assert samples['tgq_spec_accepted_tokens{batcher="b0"}'] == 50
    assert samples['tgq_spec_verify_forwards{batcher="b0"}'] == 30
    assert samples['tgq_spec_acceptance_ratio_bucket{batcher="b0",le="0.0"}'] == 10
    assert samples['tgq_spec_acceptance_ratio_bucket{batcher="b0",le="0.5"}'] == 15
    assert samples['tgq_spec_acceptance_ratio_bucket{batcher="b0",le="1.0"}'] == 30
    assert samples['tgq_spec_acceptance_ratio_bucket{batcher="b0",le="+Inf"}'] == 30
    assert samples['tgq_spec_acceptance_ratio_sum{batcher="b0"}'] == 17.5
    metrics.set_batchers([beat("b1", 1, 50, 64, 16)])  # b0's heartbeat expired
    _, samples = parse(metrics)
    assert samples["tgq_batchers_alive"] == 1
    assert 'tgq_kv_cache_usage_ratio{batcher="b0"}' not in samples
    assert samples['tgq_prefix_cache_hits{batcher="b1"}'] == 16


def test_batch_request_counts() -> None:
    metrics = new_metrics()
    _, samples = parse(metrics)
    assert samples['tgq_batch_request_counts{status="total"}'] == 0
    metrics.set_batch_request_counts({"total": 40, "completed": 12, "failed": 1})
    _, samples = parse(metrics)
    assert samples['tgq_batch_request_counts{status="completed"}'] == 12


def test_success_feeds_every_request_histogram() -> None:
    metrics = new_metrics()
    success(metrics)
    success(metrics, total_s=0.4, num_input_tokens=950, time_per_token_s=None)
    _, samples = parse(metrics)
    assert samples["tgi_request_success"] == 2
    assert samples["tgi_request_duration_count"] == 2
    assert samples["tgi_request_duration_sum"] == 2.0
    assert samples['tgi_request_duration_bucket{le="0.5"}'] == 1
    assert samples['tgi_request_duration_bucket{le="2.5"}'] == 2
    assert samples["tgi_request_validation_duration_sum"] == 0.004
    assert samples["tgi_request_mean_time_per_token_duration_count"] == 1
    assert samples["tgi_request_input_length_sum"] == 1070
    assert samples['tgi_request_input_length_bucket{le="100.0"}'] == 0
    assert samples['tgi_request_input_length_bucket{le="200.0"}'] == 1
    assert samples['tgi_request_input_length_bucket{le="1000.0"}'] == 2
    assert samples['tgi_request_generated_tokens_bucket{le="200.0"}'] == 2
    assert samples['tgi_request_max_new_tokens_bucket{le="200.0"}'] == 2


def test_histogram_buckets_are_cumulative_and_inf_equals_count() -> None:
    metrics = new_metrics()
    observed = [0.0005, 0.001, 0.003, 0.2, 0.2, 7.0, 120.0]
    for seconds in observed:
        metrics.observe_ttft(seconds)
    _, samples = parse(metrics)
    name = "tgq_time_to_first_token_seconds"
    buckets = [samples[f'{name}_bucket{{le="{bound!r}"}}'] for bound in LATENCY_BUCKETS_S]
    expected = [sum(seconds <= bound for seconds in observed) for bound in LATENCY_BUCKETS_S]
    assert buckets == expected
    assert samples[f'{name}_bucket{{le="+Inf"}}'] == samples[f"{name}_count"] == len(observed)
    assert samples[f"{name}_sum"] == sum(observed)


def test_token_buckets_end_at_the_limits() -> None:
    _, samples = parse(Metrics(max_input_tokens=4096, max_total_tokens=8192))
    assert 'tgi_request_input_length_bucket{le="409.6"}' in samples
    assert 'tgi_request_input_length_bucket{le="4096.0"}' in samples
    assert 'tgi_request_generated_tokens_bucket{le="8192.0"}' in samples
    assert 'tgi_request_max_new_tokens_bucket{le="8192.0"}' in samples


def test_job_counts_always_show_all_five_statuses() -> None:
    metrics = new_metrics()
    metrics.set_job_counts({"queued": 4, "running": 1})
    metrics.set_job_counts({"succeeded": 9})
    _, samples = parse(metrics)
    jobs = {status: samples[f'tgq_jobs{{status="{status}"}}'] for status in JOB_STATUSES}
    assert jobs == {"queued": 0, "running": 0, "succeeded": 9, "failed": 0, "cancelled": 0}


def test_label_values_are_escaped() -> None:
    metrics = new_metrics()
    err = 'say "hi"\\ok\nbye'
    metrics.on_failure(err)
    text = metrics.render().decode()
    assert 'tgi_request_failure{err="say \\"hi\\"\\\\ok\\nbye"} 1.0\n' in text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    failures = {s.labels["err"]: s.value for s in families["tgi_request_failure"].samples}
    assert failures[err] == 1


def test_exposition_parses_into_typed_families() -> None:
    metrics = new_metrics()
    success(metrics)
    metrics.observe_itl(0.02)
    text = metrics.render().decode()
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert families == TGI_TYPES | TGQ_TYPES  # no sample fell outside its family (untyped)
    assert text.endswith("\n")


def test_concurrent_updates_are_all_counted() -> None:
    metrics = new_metrics()
    num_threads, num_each = 8, 2000

    def work() -> None:
        for _ in range(num_each):
            metrics.on_request()
            metrics.observe_itl(0.01)

    threads = [threading.Thread(target=work) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _, samples = parse(metrics)
    assert samples["tgi_request_count"] == num_threads * num_each
    assert samples["tgq_inter_token_latency_seconds_count"] == num_threads * num_each
    assert samples['tgq_inter_token_latency_seconds_bucket{le="0.01"}'] == num_threads * num_each
