"""Trainer: data, microbatch scheduling, replica choice, retries, loss."""
