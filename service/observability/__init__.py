"""What watches a running service: Prometheus metrics, the dashboard's recent activity and the
event stream's readers, each fed by the event bus."""
