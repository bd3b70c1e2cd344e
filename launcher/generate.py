"""The main job: prefill a prompt, report TTFT and prefill speed, then decode."""
from __future__ import annotations

import launcher  # noqa: F401  first: run by its path, it relaunches preloaded before torch loads

import time

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from engine import SamplingParams, cpu_runtime
from launcher.hydra_main import boolean, hydra_app, text
from launcher.build_engine import llm_from_config


def _prompt(cfg: DictConfig, llm, console: Console) -> str:
    """The prompt wrapped in the model's chat template, unless chat=false or it has none."""
    tokenizer = llm.tokenizer
    if not cfg.chat:
        return cfg.prompt
    if tokenizer is None or tokenizer.chat_template is None:
        console.print("[yellow]this model has no chat template: sending the raw prompt[/]")
        return cfg.prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": cfg.prompt}])


def run(cfg: DictConfig, console: Console) -> dict:
    boolean(cfg, "chat")
    text(cfg, "prompt")
    # the sampling keys are checked here, before the model loads
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                            top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed)
    with llm_from_config(cfg) as llm:
        prompt = _prompt(cfg, llm, console)
        # one tiny request first, so the figures are the steady state's, not first-call costs
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        [out] = llm.generate([prompt], params)
        total = time.perf_counter() - start
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        result = {
            "model": cfg.model.path, "tp": llm.config.tp, "dtype": str(llm.config.torch_dtype),
            "prompt_tokens": n_prompt, "first_token": out.token_ids[0],
            "first_token_text": llm.tokenizer.piece(out.token_ids[0]) if llm.tokenizer else "",
            "ttft_s": out.ttft_s, "prefill_tokens_per_s": n_prompt / out.ttft_s,
            "decode_tokens_per_s": (n_out - 1) / (total - out.ttft_s) if n_out > 1 else float("nan"),
            "text": out.text, "finish_reason": out.finish_reason,
            "cpu_runtime": cpu_runtime.describe(),
        }
    _print(console, prompt, result)
    return result


def _print(console: Console, prompt: str, r: dict) -> None:
    table = Table(title=f"{r['model']}  tp={r['tp']}  {r['dtype']}", show_header=False)
    table.add_row("prompt tokens", str(r["prompt_tokens"]))
    table.add_row("first token", f"{r['first_token']} {r['first_token_text']!r}")
    table.add_row("TTFT", f"{r['ttft_s'] * 1e3:.1f} ms")
    table.add_row("prefill", f"{r['prefill_tokens_per_s']:.0f} tokens/s")
    table.add_row("decode", f"{r['decode_tokens_per_s']:.1f} tokens/s")
    table.add_row("finish", r["finish_reason"])
    table.add_row("this process's runtime", r["cpu_runtime"])
    console.print(table)
    # a prompt may hold square brackets: print it as text, not as rich markup
    console.print(prompt, style="bold", end="", markup=False, highlight=False)
    console.print(r["text"], markup=False, highlight=False)


@hydra_app("generate")
def main(cfg: DictConfig) -> None:
    run(cfg, Console())


if __name__ == "__main__":
    main()
