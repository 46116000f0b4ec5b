"""A worker of both roles: PrefillWorker and DecodeWorker over one engine (`pdserve decode --role both`)."""
