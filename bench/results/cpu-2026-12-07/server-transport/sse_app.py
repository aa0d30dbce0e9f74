"""Stream 64 x 400 SSE chunks through FastAPI's StreamingResponse; report server CPU seconds per chunk."""
import sys, os, time, asyncio, json
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
app = FastAPI()
@app.get("/cpu")
def cpu():
    return {"cpu": time.process_time()}
@app.get("/s")
async def s():
    async def gen():
        for i in range(400):
            yield "data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": " hi", "token_ids": [i]}]}) + "\n\n"
            await asyncio.sleep(0)
        yield "data: [DONE]\n\n"
    return StreamingResponse(gen(), media_type="text/event-stream")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
