"""HTTP pieces shared by every pdserve server (worker, router, bootstrap server): binding a
port and running uvicorn, the request-body cap, cancel-on-disconnect and OpenAI's error
body. Nothing here imports the engine, so the router depends on HTTP code only."""
