"""How the engine runs, as opposed to what it does (engine/): the thread that owns an engine and the
surface the front end uses (`EngineClient`), the engine-core process and its ZeroMQ client, and the
worker ranks of a parallel engine. Modules here import the runtime (engine/); the runtime never
imports them."""
