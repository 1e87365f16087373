"""Keys with no effect under the chosen DPO loss_type are refused, as label_smoothing with ipo is (issue 43, item 5)."""
import pytest

from maxpost.config import ConfigError, load_config


@pytest.mark.parametrize("loss_type,extra,word", [("orpo", "precompute_ref_log_probs=true", "precompute_ref_log_probs"),
                                                  ("simpo", "precompute_ref_log_probs=true", "precompute_ref_log_probs"),
                                                  ("orpo", "beta=0.5", "beta"),
                                                  ("ipo", "label_smoothing=0.1", "label_smoothing")])
def test_a_key_without_effect_is_refused(tmp_path, loss_type, extra, word):
    with pytest.raises(ConfigError) as e:
        load_config("dpo", [f"base_output_directory={tmp_path}", f"loss_type={loss_type}", extra])
    assert f"{word}=" in str(e.value) and "has no effect" in str(e.value) and loss_type in str(e.value)


@pytest.mark.parametrize("args", [["loss_type=orpo", "lambda_orpo=0.2"], ["loss_type=sigmoid", "precompute_ref_log_probs=true"],
                                  ["loss_type=simpo", "beta=2.0"]])
def test_keys_with_an_effect_pass(tmp_path, args):
    load_config("dpo", [f"base_output_directory={tmp_path}", *args])
