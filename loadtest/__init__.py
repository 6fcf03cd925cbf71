"""Load tests of the gateway's ``recsys.v1.Ranker/Score`` with Locust (see ``loadtest.run``)."""
