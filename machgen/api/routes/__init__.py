"""The API's routes, a FastAPI router per resource: images, videos, jobs, models, the playground page, and
health with metrics. app.py includes them; pipeline.py is the request pipeline image and video jobs share."""
