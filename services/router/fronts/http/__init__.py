"""The router's OpenAI-compatible HTTP API (FastAPI + uvicorn), served beside gRPC by the
same routing core; see docs/openai.md.

    config.py    HttpConfig                 schemas.py  request bodies (pydantic)
    translate.py body -> GenerateInputs     backend.py  the router core it calls
    runs.py      choices in threads <-> event loop
    replies.py   response bodies and chunks (logprobs.py: both logprob formats)
    choice_text.py, tool_calls.py   a chat choice's message: content, tool calls, reasoning
    output_parsers.py  tool_choice "auto" and --reasoning-parser; parsing/: the parsers
    errors.py    OpenAI error JSON          auth.py     the API key check
    app.py       the routes                 server.py   uvicorn on a background thread
"""
