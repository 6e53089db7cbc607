"""Uploaded files (the OpenAI Files API): where their bytes live (`storage`). Their records are
in `api.db.files`, their routes in `api.routes.files`."""
