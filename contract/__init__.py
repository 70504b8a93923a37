"""kvpilot's shared contract: what the engine, the operator and the router must agree on, in one
place that all three import and that imports none of them.

Each module here is torch-free and cheap to import (the router and the operator load it without
the engine's runtime).
"""
