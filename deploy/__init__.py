"""Deployment: the CLI, Ray placement of the gateway and the two worker pools, calibration."""

from vlkv.common.checkout import drop_checkout_root

# Before any submodule imports transformers (a Ray worker of a driver started in the checkout imports this
# package first); see vlkv.common.checkout.
drop_checkout_root()
