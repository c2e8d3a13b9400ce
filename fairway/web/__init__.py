"""The chat page's static files (index.html, app.js, style.css), served by fairway.gateway.web."""
