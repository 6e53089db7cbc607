"""Uploaded files (the OpenAI Files API): where their bytes live (`storage`), how an upload is
parsed as it arrives (`multipart`) and how a batch input file is checked (`batch_input`). Their
records are in `api.db.files`, their routes in `api.routes.files`."""
