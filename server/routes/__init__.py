"""One router per API: chat, completions, models (+ tokenize), health (+ metrics, debug), traces.

Handlers are module-level functions that take the typed ``AppState``
(``server.state.State``) as a dependency; ``server.app.build_app`` includes
the routers. A new endpoint goes in the router of its API, or a new module here.
"""
