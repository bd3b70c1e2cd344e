"""`python -m launcher.serve`: the engine behind an OpenAI-compatible HTTP API (app.py), on this
machine under uvicorn, or with serve.ray=true as Ray Serve deployments (ray_app.py)."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from launcher.build_engine import CONF_DIR, engine_settings, llm_from_config


def serve_local(cfg: DictConfig) -> None:
    import uvicorn

    from launcher.serve.app import build_app
    from launcher.serve.engine_handler import EngineHandler

    with llm_from_config(cfg) as llm:
        handler = EngineHandler(llm, cfg.serve.model_name or cfg.model.path,
                                cfg.serve.restart_on_failure)
        app = build_app(handler, cfg.serve.api_key, cfg.serve.max_queued)
        uvicorn.run(app, host=cfg.serve.host, port=cfg.serve.port, log_level=cfg.serve.log_level)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="serve")
def main(cfg: DictConfig) -> None:
    if cfg.serve.ray:
        from launcher.serve.ray_app import serve_on_ray

        serve_on_ray(cfg, engine_settings(cfg))
    else:
        serve_local(cfg)
