"""How a person starts the engine: Hydra apps, Ray cluster connection, reports."""
