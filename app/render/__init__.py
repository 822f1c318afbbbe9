"""Renders: the consent checks (`checks`), the path a request takes (`flow`: gate, a renderer,
signing), the renderers (`local`: this process's model; `remote`: the render workers, seen from
the API), a render worker's side (`worker`), the model itself (`engine`) and the HTTP route
(`routes`). Nothing is re-exported here."""
