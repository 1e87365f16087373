"""`maxpost convert` refuses bad inputs with one line and exit 2 (issue 43, item 5)."""
import json

from maxpost.checkpoint import save_hf
from maxpost.convert import convert_main
from maxpost.model import create_model, get_model_config


def test_an_empty_adapter_config_is_one_line_and_exit_2(tmp_path, capsys):
    "`{}` as adapter_config.json used to be `KeyError: 'r'` with a traceback and exit 1."
    src = save_hf(create_model(get_model_config("tiny", num_layers=1, d_model=32, mlp_dim=64, vocab_size=64,
                                                num_heads=2, num_kv_heads=1), seed=0), tmp_path / "hf")
    (tmp_path / "ad").mkdir(); (tmp_path / "ad" / "adapter_config.json").write_text("{}")
    rc = convert_main([str(src), str(tmp_path / "out"), "--to", "hf", "--adapter", str(tmp_path / "ad")])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "'r'" in err and "adapter_config.json" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
