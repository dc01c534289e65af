import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sleuth.system.models import encode_chat, load_causal_lm, load_tokenizer


def test_cli_writes_a_loadable_model_with_chatml(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    proc = subprocess.run([sys.executable, "-m", "sleuth.testing.tiny_model", str(out), "--hidden", "32"],
                          capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == str(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 32 and model.config.vocab_size == 272
    tok = AutoTokenizer.from_pretrained(out)
    text = "Zoë said: 42 < 43\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one token per byte
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id == 258
    prompt = encode_chat(load_tokenizer(str(out)), [{"role": "user", "content": "hi"}])
    assert tok.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    lm = load_causal_lm(str(out))
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), 272) and bool(torch.isfinite(logits).all())
    # Random init is varied enough that the next-token distribution is far from uniform.
    assert float(torch.softmax(logits[0, -1], -1).max()) > 2 / 272
