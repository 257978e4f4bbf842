"""Model families beyond the paper's: each module here is one family, a Flax module
registered with `capsjax.models.register_model` and its objective with
`capsjax.objectives.register_objective`. Every module is imported on first use of the
registries, so adding a family is adding one file (see BUILD.md)."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
  importlib.import_module(f'{__name__}.{_module.name}')
