"""vlkv's lab: evaluation, benchmarks, simulation, training and the model zoo (not in the product wheel)."""

from vlkv.common.checkout import drop_checkout_root

# Before any submodule imports transformers; see vlkv.common.checkout.
drop_checkout_root()
