"""Webhooks: endpoints and the durable outbox (over `kvhandoff.service.storage`), the dispatcher and
its HTTP sender, the allowed targets, Standard Webhooks signatures and the webhook API's answers."""
