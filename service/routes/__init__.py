"""HTTP routes, one module per resource: health (operations), predict (v1), v2 (Open Inference Protocol),
admin (hot reload), explain (explanations, gallery, live activity), page (the page at /)."""
