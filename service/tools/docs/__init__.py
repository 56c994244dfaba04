"""The documentation site's generated reference pages (docs/reference/), built from the code's
own definitions so they cannot drift: the HTTP API from the OpenAPI document the service serves,
the configuration keys from the config Structs, the event types from the event union and the
metrics from the registry and collectors a service exposes.

`python -m kvhandoff.service.tools.docs` rewrites the pages (`make docs`); `--check` fails, naming
the page, when a committed page differs from what the code says (tests/unit/test_docs.py runs it).
"""
