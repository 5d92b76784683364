"""A device that cannot hold the model alone is told so at once, with what to do."""

from meshd.model.fit import PACKED_BYTES_PER_WEIGHT, fit_advice, weight_bytes


def test_the_weight_estimate_is_the_loaded_stages_parameters(real_source, real_stage):
    loaded = real_stage.weight_bytes()  # the embedded model is float32 on the CPU
    assert abs(weight_bytes(real_source.config, 4) - loaded) / loaded < 0.02


def test_a_device_too_small_is_told_to_add_a_device(real_source):
    need_mb = weight_bytes(real_source.config, 4) / 2**20
    assert fit_advice(real_source.config, 4, int(need_mb) + 1, "m", "float32") is None
    advice = fit_advice(real_source.config, 4, int(need_mb / 2), "m", "float32")
    assert "meshd invite" in advice and "pools memory" in advice and "--weights packed" in advice
    packed = fit_advice(real_source.config, PACKED_BYTES_PER_WEIGHT, 16, "m", "packed")
    assert "--weights packed" not in packed  # nothing smaller to suggest
    assert weight_bytes(real_source.config, PACKED_BYTES_PER_WEIGHT) < weight_bytes(real_source.config, 4) / 6
