"""One MCP session against airlock, driven by the official Python SDK (PyPI `mcp`).

    mcp_session.py http URL [--token TOKEN] [--foreign-delivery ID] [--transcript PATH]
    mcp_session.py stdio BINARY --api-url URL --token TOKEN [--foreign-delivery ID] [--transcript PATH]

Initializes, lists the tools, starts a run, submits an email, reads its delivery, then
tries what must be refused (an unknown argument, another agent's delivery, a tool that
does not exist). Prints one JSON object with what each step answered, for the Rust test
to check; nothing is judged here. Without a token over HTTP, prints what the connection
attempt raised instead, with the HTTP statuses airlock answered. With --transcript, writes every request and answer there.
"""

import argparse
import asyncio
import json
import sys

import mcp
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


def dump(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


class Recorder:
    """Calls the session and keeps every exchange, in order."""

    def __init__(self, session):
        self.session = session
        self.exchanges = []

    async def initialize(self):
        result = await self.session.initialize()
        self.exchanges.append({"request": {"method": "initialize"}, "result": dump(result)})
        return result

    async def list_tools(self):
        result = await self.session.list_tools()
        self.exchanges.append({"request": {"method": "tools/list"}, "result": dump(result)})
        return result

    async def call(self, name, arguments):
        request = {"method": "tools/call", "params": {"name": name, "arguments": arguments}}
        try:
            result = await self.session.call_tool(name, arguments)
        except mcp.MCPError as e:
            error = {"code": e.code, "message": e.message}
            self.exchanges.append({"request": request, "error": error})
            return {"protocol_error": error}
        self.exchanges.append({"request": request, "result": dump(result)})
        return {"is_error": result.is_error, "structured": result.structured_content,
                "text": [c.text for c in result.content if getattr(c, "type", None) == "text"]}


async def scenario(session, foreign_delivery):
    rec = Recorder(session)
    init = await rec.initialize()
    tools = await rec.list_tools()
    out = {
        "server": {"name": init.server_info.name, "protocol_version": init.protocol_version},
        "tools": [{"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in tools.tools],
    }
    run = await rec.call("start_run", {"budget": {"max_steps": 10}, "inputs": {"task": "say hello"}})
    out["run"] = run
    run_id = (run.get("structured") or {}).get("id")
    email = {"from": "agent@example.com", "to": ["a@example.org"], "subject": "Hello",
             "text": "Hello from an agent over MCP."}
    submitted = await rec.call("submit_email", {"run_id": run_id, "step_id": "draft-1", "email": email})
    out["submitted"] = submitted
    delivery_id = (submitted.get("structured") or {}).get("id")
    out["delivery"] = await rec.call("get_delivery", {"delivery_id": delivery_id})
    out["again"] = await rec.call("submit_email", {"run_id": run_id, "step_id": "draft-1", "email": email})
    out["unknown_argument"] = await rec.call("get_delivery", {"delivery_id": delivery_id, "approve": True})
    out["missing_argument"] = await rec.call("submit_email", {"run_id": run_id, "email": email})
    if foreign_delivery:
        out["foreign_delivery"] = await rec.call("get_delivery", {"delivery_id": foreign_delivery})
    out["unknown_tool"] = await rec.call("approve_delivery", {"delivery_id": delivery_id})
    return out, rec.exchanges


# The HTTP statuses airlock answered, in order (the SDK's errors do not carry them).
STATUSES = []


async def record_status(response):
    STATUSES.append(response.status_code)


async def over_http(args):
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    async with create_mcp_http_client(headers=headers) as http:
        http.event_hooks["response"].append(record_status)
        async with streamable_http_client(args.target, http_client=http) as (read, write):
            async with mcp.ClientSession(read, write) as session:
                return await scenario(session, args.foreign_delivery)


async def over_stdio(args):
    params = mcp.StdioServerParameters(
        command=args.target, args=[], env={"AIRLOCK_API_URL": args.api_url, "AIRLOCK_TOKEN": args.token or ""})
    async with mcp.stdio_client(params) as (read, write):
        async with mcp.ClientSession(read, write) as session:
            return await scenario(session, args.foreign_delivery)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("transport", choices=["http", "stdio"])
    p.add_argument("target", help="the /mcp URL, or the airlock-mcp binary")
    p.add_argument("--token")
    p.add_argument("--api-url")
    p.add_argument("--foreign-delivery")
    p.add_argument("--transcript")
    args = p.parse_args()
    run = over_http if args.transport == "http" else over_stdio
    try:
        out, exchanges = asyncio.run(asyncio.wait_for(run(args), timeout=60))
    except Exception as e:  # what the connection attempt raised, for the caller to judge
        causes = []
        while e is not None:
            for inner in getattr(e, "exceptions", []) or []:
                causes.append(f"{type(inner).__name__}: {inner}")
            causes.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        print(json.dumps({"failed": causes, "http_statuses": STATUSES}))
        return
    if args.transcript:
        with open(args.transcript, "w") as f:
            json.dump(exchanges, f, indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
