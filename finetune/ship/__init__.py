"""Shipping a run: the Hub push and its model card (finetune.ship.hub, finetune.ship.card)."""
