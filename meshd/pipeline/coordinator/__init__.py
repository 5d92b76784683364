"""The coordinator: drives this device's requests through the stages of the home's routes.

A request's way through it, top to bottom: :mod:`.service` (``PipelineCoordinator``)
admits it to a :mod:`.slot` and takes a route (:mod:`.routes`); each :mod:`.attempt`
opens a sequence (:mod:`.flights`), starts it on what the stages' caches hold
(:mod:`.prefix_reuse`), sends the prompt cut into chunks (:mod:`.cuts`), then each new
token; when a device fails (:mod:`.failures`) the service replays the request as a
new attempt on a fresh sequence.

- :mod:`.service` — ``PipelineCoordinator``: follows the plans, runs each request's loop and its replays
- :mod:`.attempt` — one pass of a request on one route: prefill scheduling, then the decode loop
- :mod:`.slot` — one request as the coordinator holds it: what was asked, and where it stands
- :mod:`.routes` — the current plan's routes: which serve, and which one a request takes (and waits for)
- :mod:`.flights` — the sequences in flight: where each one's results go, and freeing them surely
- :mod:`.prefix_reuse` — how much of a prompt a request takes from the stages' prefix caches
- :mod:`.verify_rounds` — speculative decoding through the mesh: verify rounds drafted here
- :mod:`.drafter` — the mesh drafting, step by step, for a cloud verifier
- :mod:`.failures` — what can go wrong with a request, and which device it is blamed on
- :mod:`.cuts` — where a prompt is cut into chunks for the intra-sequence pipeline
- :mod:`.workload` — what this coordinator's requests look like (the layout planner prices it)
"""
