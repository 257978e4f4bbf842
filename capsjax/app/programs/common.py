"""What the experiment programs share: comparison-model configs (plots: capsjax.app.plots;
markdown tables: capsjax.reports)."""
import ml_collections


def with_model_of(config, key: str) -> ml_collections.ConfigDict:
  """config with the model and loss of config[key] (a comparison model such as a CNN
  baseline): the same data, optimiser and schedule; experiment named EXPERIMENT_KEY."""
  derived = ml_collections.ConfigDict(config.to_dict())
  derived.experiment = f'{config.experiment}_{key}'
  derived.model = ml_collections.ConfigDict(config[key].model.to_dict())
  derived.loss = ml_collections.ConfigDict(config[key].loss.to_dict())
  return derived
