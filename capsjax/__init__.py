"""capsjax: Dynamic Routing Between Capsules (Sabour, Frosst, Hinton 2017) in JAX/Flax."""
__version__ = '0.1.0'
